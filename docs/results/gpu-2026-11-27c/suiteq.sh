#!/bin/bash
# the fast-route test files with the hopper extra (quack installed by install.sh; part-aa and wheels copied before)
export PYTHONUNBUFFERED=1
bash .scratch/qc3/install.sh > $OUT/suiteq.txt 2>&1 || { tail -5 $OUT/suiteq.txt; exit 1; }
QUACK=1 SUITE_T=${SUITE_T:-450} G=4 FILES="tests/test_triton_backend.py tests/test_variants.py tests/test_caller_reduced.py tests/test_integration_trl.py tests/test_distillation_triton.py tests/test_confident_tokens.py tests/test_metrics.py tests/test_class_weight.py" bash .scratch/qc3/suite.sh >> $OUT/suiteq.txt 2>&1
cat $OUT/suiteq.txt | tail -20
