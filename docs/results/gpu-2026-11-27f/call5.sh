#!/bin/bash
# call C (right after B; quack installed, /tmp/pick.txt from B): the se tree at the picked LOGITS_TILE; A/B main /
# se, then se / main (floor, plain, soft cap, DFT, frozen, all four options), both heads; no run starts after 470 s.
export PYTHONUNBUFFERED=1
R=$PWD/.scratch/qc9/trees
grep -q LOGITS_TILE /tmp/pick.txt && sed -i "s/^LOGITS_TILE = .*/$(cat /tmp/pick.txt)/" $R/se/vpce/gemm.py
grep -n "^LOGITS_TILE" $R/se/vpce/gemm.py > $OUT/ab-se.txt
export END=$(( $(date +%s) + 470 ))
M=se:floor,vpce-triton,vpce-softcap,vpce-dft,vpce-triton-frozen,vpce-all
ORDER="main BR" T=100 bash .scratch/qc9/ab9.sh $OUT/ab-se.txt $M
ORDER="BR main" T=100 bash .scratch/qc9/ab9.sh $OUT/ab-se.txt $M
cut -c1-700 $OUT/ab-se.txt
