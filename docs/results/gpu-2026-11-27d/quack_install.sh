set -e
Q=/tmp/quack/site-packages
cat /tmp/quack/cu13.tar.xz.part-aa .scratch/qc2/cu13.tar.xz.part-ab > /tmp/quack/cu13.tar.xz
echo "cf0eb28aa9404a79119fa077462319ffb82b917f41d2ec9a9478970ab788a34b  /tmp/quack/cu13.tar.xz" | sha256sum -c --quiet
rm -rf $Q && mkdir -p $Q
python3 -m pip install -q --no-index --no-deps --no-compile --target $Q /tmp/quack/wheels/*.whl
tar -xJf /tmp/quack/cu13.tar.xz -C $Q
PYTHONPATH=$Q:$Q/nvidia_cutlass_dsl/dsl_packages python3 -c "import quack.gemm_interface, quack.linear_cross_entropy; print('quack ok')"
