#!/bin/bash
# call C: A/B main / op4 (one-pass at 4096 columns x 1 row x 8 warps) with the extra: plain, DFT, metrics, soft cap
export PYTHONUNBUFFERED=1
H=.scratch/qc7
ORDER="main BR" T=80 bash $H/ab7.sh $OUT/ab-op4.txt op4:floor,vpce-triton,vpce-dft,vpce-metrics,vpce-softcap
cut -c1-600 $OUT/ab-op4.txt
