#!/usr/bin/env bash
# quack-kernels 0.6.5 and the CuTe DSL it runs on, as wheels for the GPU machine (CPython 3.12, x86_64, no network
# there), for the quack rows of `python -m vpce.bench` (quack, quack-base and their -frozen variants):
#
#   bash launch/quack_wheels.sh          # here, where PyPI is reachable; fills .whl-quack/ (git-ignored)
#
# and prints the device recipe, with the file names and checksum filled in. The wheels:
#   quack-kernels 0.6.5          nvidia-cutlass-dsl>=4.7, torch, apache-tvm-ffi<0.2,>=0.1.6, torch-c-dlpack-ext, einops
#   nvidia-cutlass-dsl 4.7.1     only a .pth file; libs-base 4.7.1 (libs-core 4.7.1) are the DSL; its libs-cu12 is
#                                not fetched: the GPU image has torch 2.11+cu130, so libs-cu13 4.7.1 instead
#   apache-tvm-ffi 0.1.15.post2, torch-c-dlpack-ext 0.1.5, einops 0.8.2 (pinned: what quack 0.6.5 accepted on
#                                2026-11-23)
# Their other needs (numpy, typing-extensions, cuda-python, protobuf, nvidia-cuda-nvdisasm) are in the GPU image.
# nvidia-cutlass-dsl 4.8.x breaks quack 0.6.5 (a new ContextVar); keep 4.7.1.
#
# nvidia-cutlass-dsl-libs-cu13 is 88 MB, more than one device call may carry with the rest (64 MiB a call, the
# working tree included). It is split into parts under 40 MB (`split -b`: aa, ab, ac) and the 88 MB shared out so
# that each call carries under 50 MB beside a ~10 MiB working tree: the first call the first and the last part,
# which wait in /tmp; the second call, while the machine is still warm, the middle parts and the small wheels
# (9 MB), and reassembles the wheel with cat. (The first part alone in the first call left 56 MB for the second,
# over the limit with the working tree: 2026-11-27.) Layout:
#   .whl-quack/download/   every wheel as downloaded
#   .whl-quack/call1/      the first and the last part  (carry it in the first call)
#   .whl-quack/call2/      the middle parts, wheels/    (carry it in the second call)
# On the device the small wheels go in with `pip install --no-deps --target DIR` first, then the cu13 wheel is
# unpacked over them with `python3 -m zipfile -e` (the image has no unzip; the two share nvidia_cutlass_dsl/).
# DIR's path must contain `site-packages`: quack refuses to fingerprint functions outside one ("no fail-closed
# semantic key"). PYTHONPATH needs DIR and DIR/nvidia_cutlass_dsl/dsl_packages: a .pth file is not read from
# PYTHONPATH. See /work/shared/anchors/README.md, "Getting quack onto the GPU machine".
set -euo pipefail
cd "$(dirname "$0")/.."
dest=.whl-quack
part_bytes=39000000
small=(quack-kernels==0.6.5 nvidia-cutlass-dsl==4.7.1 nvidia-cutlass-dsl-libs-base==4.7.1
       nvidia-cutlass-dsl-libs-core==4.7.1 apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5 einops==0.8.2)
big=nvidia-cutlass-dsl-libs-cu13==4.7.1
platforms=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64
           manylinux2014_x86_64 manylinux1_x86_64)

mkdir -p "$dest/download"
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]/#/--platform=}" -d "$dest/download" "${small[@]}" "$big"

wheels=("$dest"/download/nvidia_cutlass_dsl_libs_cu13-4.7.1-*.whl)
wheel=${wheels[0]}
name=$(basename "$wheel")
rm -rf "$dest/call1" "$dest/call2"
mkdir -p "$dest/call1" "$dest/call2/wheels"
for f in "$dest"/download/*.whl; do
    [[ $f == "$wheel" ]] || cp "$f" "$dest/call2/wheels/"
done
split -b "$part_bytes" "$wheel" "$dest/call2/$name.part-"
parts=($(cd "$dest/call2" && ls "$name".part-*))
mv "$dest/call2/${parts[0]}" "$dest/call1/"
[[ ${#parts[@]} -gt 2 ]] && mv "$dest/call2/${parts[-1]}" "$dest/call1/"
first=$(cd "$dest/call1" && ls "$name".part-* | tr '\n' ' ')
q=/tmp/quack
every=""  # every part in order, from /tmp/quack where the first call left it, else from call2
for part in "${parts[@]}"; do
    if [[ -f "$dest/call1/$part" ]]; then every+="$q/$part "; else every+=".whl-quack/call2/$part "; fi
done
sha=$(sha256sum "$wheel" | cut -d' ' -f1)

ls -l "$dest/download" "$dest/call1" "$dest/call2" "$dest/call2/wheels"
du -sh "$dest/call1" "$dest/call2"
path="$q/site-packages:$q/site-packages/nvidia_cutlass_dsl/dsl_packages"
cat <<EOF

On the GPU machine, two calls (the second while the machine is still warm, so that /tmp survives):
  1. carry [".whl-quack/call1"]:
     mkdir -p $q && cp .whl-quack/call1/$name.part-* $q/
  2. carry [".whl-quack/call2"]:
     cat ${every}> $q/$name && echo "$sha  $q/$name" | sha256sum -c --quiet && python3 -m pip install -q --no-index --no-deps --no-compile --target $q/site-packages .whl-quack/call2/wheels/*.whl && python3 -m zipfile -e $q/$name $q/site-packages && export PYTHONPATH=$path\${PYTHONPATH:+:\$PYTHONPATH} && python3 -c "import quack.linear_cross_entropy" && python -m vpce.bench ...
Later calls, while it stays warm: export PYTHONPATH=$path\${PYTHONPATH:+:\$PYTHONPATH}; python -m vpce.bench ...
EOF
