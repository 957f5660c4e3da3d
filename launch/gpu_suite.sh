#!/usr/bin/env bash
# The whole test suite on a GPU machine, every GPU busy. From the repository root:
#
#   bash launch/gpu_suite.sh                 # writes gpu-suite/summary.txt and one log per group
#   OUT_DIR=/some/folder bash launch/gpu_suite.sh -x   # extra arguments go to every pytest process
#
# 1. tests/backends/test_memory_route.py first, alone on the first GPU: it weighs the device's free memory;
# 2. the other test files dealt round-robin (by size, largest first) into one group per GPU, each group one
#    pytest process on its own GPU, with pytest-xdist's workers (WORKERS per GPU, default 4) where pytest-xdist is
#    installed. The GPUs are those CUDA_VISIBLE_DEVICES names (all where it is unset), so two runs can share a
#    machine, e.g. CUDA_VISIBLE_DEVICES=0,1 with the `hopper` extra and CUDA_VISIBLE_DEVICES=2,3 without it;
# 3. the files with tests that need two GPUs (tests/parallel/test_multi_gpu.py, test_distillation_tp.py's NCCL
#    case) once more with every GPU visible, where there are two or more (with one GPU visible those tests skip).
# The quack-based route is taken where quack-kernels (the `hopper` extra) is importable; the summary says which.
# Exit status: 0 when every pytest process passed (or found nothing to run), 1 otherwise.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT_DIR:-gpu-suite}
workers=${WORKERS:-4}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
ngpu=$(python3 -c "import torch; print(torch.cuda.device_count())")
if [ "$ngpu" -lt 1 ]; then echo "gpu_suite.sh: no CUDA device here" >&2; exit 2; fi
# the GPUs this script may use, as CUDA_VISIBLE_DEVICES names them (all of them where it is unset)
gpus=($(seq 0 $((ngpu - 1))))
[ -n "${CUDA_VISIBLE_DEVICES:-}" ] && IFS=, read -ra gpus <<< "$CUDA_VISIBLE_DEVICES"
all=$(IFS=,; echo "${gpus[*]}")
xdist=()
python3 -c "import xdist" 2>/dev/null && xdist=(-n "$workers" --dist loadfile)
pt=(python3 -m pytest -q -p no:cacheprovider -rfE "$@")
summary=$out/summary.txt
{
    nvidia-smi --query-gpu=index,name --format=csv,noheader
    python3 -c "import importlib.util as u; print('hopper extra (quack) importable:', u.find_spec('quack') is not None)"
    echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
} > "$summary"
status=0

CUDA_VISIBLE_DEVICES=${gpus[0]} "${pt[@]}" tests/backends/test_memory_route.py > "$out/memory_route.log" 2>&1 || status=1
echo "memory_route: $(tail -1 "$out/memory_route.log")" >> "$summary"

mapfile -t files < <(find tests -name 'test_*.py' ! -name test_memory_route.py ! -name test_multi_gpu.py \
    -printf '%s %p\n' | sort -rn | cut -d' ' -f2)
declare -a groups
for i in "${!files[@]}"; do groups[$((i % ngpu))]+=" ${files[$i]}"; done
pids=()
for g in "${!groups[@]}"; do
    # shellcheck disable=SC2086
    CUDA_VISIBLE_DEVICES=${gpus[$g]} "${pt[@]}" "${xdist[@]}" ${groups[$g]} > "$out/group-$g.log" 2>&1 &
    pids+=($!)
done
for g in "${!pids[@]}"; do
    wait "${pids[$g]}"; rc=$?
    [ $rc -eq 0 ] || [ $rc -eq 5 ] || status=1
    echo "group $g (GPU ${gpus[$g]}): $(tail -1 "$out/group-$g.log")" >> "$summary"
    grep -E "^(FAILED|ERROR)" "$out/group-$g.log" | head -20 >> "$summary"
done

if [ "$ngpu" -ge 2 ]; then
    two=($(find tests -name test_multi_gpu.py -o -name test_distillation_tp.py))
    CUDA_VISIBLE_DEVICES=$all "${pt[@]}" "${two[@]}" -k "gpu or nccl" > "$out/multi_gpu.log" 2>&1; rc=$?
    [ $rc -eq 0 ] || [ $rc -eq 5 ] || status=1
    echo "multi_gpu (all GPUs): $(tail -1 "$out/multi_gpu.log")" >> "$summary"
    grep -E "^(FAILED|ERROR)" "$out/multi_gpu.log" | head -20 >> "$summary"
fi
cat "$summary"
exit $status
