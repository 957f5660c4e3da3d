#!/bin/bash
# quack 0.6.5 + nvidia-cutlass-dsl 4.7.1 into /tmp/quack/site-packages (parts aa, ac from call A; ab and wheels here)
Q=/tmp/quack; N=nvidia_cutlass_dsl_libs_cu13-4.7.1-cp312-cp312-manylinux_2_28_x86_64.whl
[ -f $Q/site-packages/quack/__init__.py ] && { echo "quack already installed"; exit 0; }
cat $Q/$N.part-aa .dev/q2/$N.part-ab $Q/$N.part-ac > $Q/$N && \
echo "20c14e16125cb8e36bc9947a9f0a57a660f44651365337b911c84abde4967f5f  $Q/$N" | sha256sum -c --quiet && \
python3 -m pip install -q --no-index --no-deps --no-compile --target $Q/site-packages .dev/q2/wheels/*.whl && \
python3 -m zipfile -e $Q/$N $Q/site-packages && \
PYTHONPATH=$Q/site-packages:$Q/site-packages/nvidia_cutlass_dsl/dsl_packages python3 -c "import quack.gemm_interface, quack.linear_cross_entropy; print('quack ok')"
