#!/usr/bin/env bash
# verl 0.9.1 and what importing its actor loss takes, as wheels for the GPU machine (CPython 3.12, x86_64, no
# network there), for the verl rows of `python -m vpce.bench` (vpce-verl, liger-verl):
#
#   bash launch/verl_wheels.sh          # here, where PyPI is reachable; fills .whl-verl/ (git-ignored)
#
# and prints the device recipe. Only the import-time needs of `verl.trainer.ppo.core_algos` and
# `verl.workers.utils.losses` that the GPU image lacks are fetched (verl's own pins are not: the image's
# transformers, accelerate, numpy, scipy, pyarrow, ... serve):
#   verl 0.9.1, ray 2.60.0 (core_algos imports ray.dag), tensordict 0.10.0 (with pyvers, orjson), omegaconf 2.4.0,
#   codetiming 1.4.0, datasets 5.2.0 (with dill, multiprocess), jsonschema 4.26.0 (with jsonschema-specifications,
#   referencing, rpds-py: ray's)
#
# ray's wheel is 79 MB, more than one upload to a GPU machine limited to 64 MiB (the working tree included) may
# hold: it is split into two parts (`split -b`), and the small wheels go with the first:
#   .whl-verl/first/    the small wheels and ray's first part   (upload it with the first command)
#   .whl-verl/second/   ray's second part                       (with the next one, the machine still warm)
# With the quack wheels (launch/quack_wheels.sh) that is four commands in a row; the last one runs the bench.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=.whl-verl
part_bytes=40000000
small=(verl==0.9.1 tensordict==0.10.0 pyvers==0.1.0 orjson==3.13.0 omegaconf==2.4.0 codetiming==1.4.0
       datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 jsonschema==4.26.0 jsonschema-specifications==2025.9.1
       referencing==0.37.0 rpds-py==0.30.0)
big=ray==2.60.0
platforms=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64
           manylinux2014_x86_64 manylinux1_x86_64)

mkdir -p "$dest/download"
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]/#/--platform=}" -d "$dest/download" "${small[@]}" "$big"

wheels=("$dest"/download/ray-2.60.0-*.whl)
wheel=${wheels[0]}
name=$(basename "$wheel")
rm -rf "$dest/first" "$dest/second"
mkdir -p "$dest/first" "$dest/second"
for f in "$dest"/download/*.whl; do
    [[ $f == "$wheel" ]] || cp "$f" "$dest/first/"
done
split -b "$part_bytes" "$wheel" "$dest/second/$name.part-"
first=$(cd "$dest/second" && ls "$name".part-* | head -1)
mv "$dest/second/$first" "$dest/first/"
sha=$(sha256sum "$wheel" | cut -d' ' -f1)

ls -l "$dest/first" "$dest/second"
du -sh "$dest/first" "$dest/second"
s=/tmp/verl
cat <<EOF

On the GPU machine, two commands (the second while the machine is still warm, so that /tmp survives):
  1. with .whl-verl/first uploaded:
     mkdir -p $s && cp .whl-verl/first/* $s/
  2. with .whl-verl/second uploaded:
     cat $s/$name.part-* .whl-verl/second/$name.part-* > $s/$name && echo "$sha  $s/$name" | sha256sum -c --quiet && python3 -m pip install -q --no-index --no-deps --no-compile --target $s/site-packages $s/*.whl && export PYTHONPATH=$s/site-packages\${PYTHONPATH:+:\$PYTHONPATH} && python3 -c "import verl.trainer.ppo.core_algos, verl.workers.utils.losses" && python -m vpce.bench ...
Put the repository's root first on PYTHONPATH (verl's wheel installs a top-level tests/ package).
EOF
