#!/bin/bash
# call C: quack installed; bench_tp dyn / dynh / main / dyn / dynh (dyn = main with quack's dynamic persistent tile
# scheduler in every vpce quack GEMM; dynh = dyn with each chunk's statistics in one launch under a group);
# profiles of dyn and dynh (timelines); tp=1 Llama bench main vs dyn (GPU 0 / GPU 1 at once, then swapped)
export PYTHONUNBUFFERED=1
L=$OUT/c.txt; S=$PWD/.dev/s; R=$PWD/.dev/trees
Q=/tmp/quack/site-packages; QP=$Q:$Q/nvidia_cutlass_dsl/dsl_packages
END=$(( $(date +%s) + ${KT:-560} ))
nvidia-smi --query-gpu=name --format=csv,noheader > $L
bash $S/install.sh >> $L 2>&1 || { echo install failed; cat $L; exit 1; }
prof() {  # tag tree
  local tag=$1 tree=$2
  [ $(date +%s) -gt $((END - 75)) ] && { echo "prof $tag skipped" >> $L; return; }
  (cd $R/$tree && PYTHONPATH=$R/$tree:$QP timeout 80 torchrun --standalone --nproc-per-node 2 launch/profile_tp.py \
     --reps 12 --profile-steps 4 --out /tmp/prof-$tag > /tmp/prof-$tag.txt 2>&1)
  echo "== $tag $(grep median /tmp/prof-$tag.txt)" >> $L
  grep -E "quackgemm|nvjet|vpce_stats|AllReduce|AllGather" /tmp/prof-$tag.txt >> $L
  for r in 0 1; do echo "# $tag rank $r" >> $OUT/tl.txt; python3 $S/timeline.py /tmp/prof-$tag/trace-tp2-rank$r.json 2>&1 | grep -v "gap 0.0" >> $OUT/tl.txt; done
}
bench() {  # tag tree
  local tag=$1 tree=$2
  [ $(date +%s) -gt $((END - 60)) ] && { echo "bench $tag skipped" >> $L; return; }
  rm -rf /tmp/tp; (cd $R/$tree && PYTHONPATH=$R/$tree:$QP timeout 75 torchrun --standalone --nproc-per-node 2 \
     launch/bench_tp.py --methods floor,vpce-triton --out /tmp/tp >> $OUT/bench.log 2>&1)
  python3 $S/tp2.py "tp2 $tag" /tmp/tp/bench-tp2.json >> $L 2>&1
}
one() {  # gpu tree tag
  (cd $R/$2 && CUDA_VISIBLE_DEVICES=$1 PYTHONPATH=$R/$2:$QP timeout 120 python3 -m vpce.bench --shapes llama3-8b \
     --methods floor,vpce-triton --skip-no-grad --row-timeout 100 --out /tmp/one-$3 > /tmp/one-$3.log 2>&1)
  python3 $S/rows.py "tp1 $3 gpu$1" /tmp/one-$3/bench.json
}
bench dyn dyn
bench dynh dynh
bench main main
bench dyn2 dyn
bench dynh2 dynh
prof dyn dyn
prof dynh dynh
if [ $(date +%s) -lt $((END - 130)) ]; then
  one 0 main m0 > /tmp/o1 2>&1 & one 1 dyn d1 > /tmp/o2 2>&1 & wait; cat /tmp/o1 /tmp/o2 >> $L
fi
if [ $(date +%s) -lt $((END - 130)) ]; then
  one 0 dyn d0 > /tmp/o1 2>&1 & one 1 main m1 > /tmp/o2 2>&1 & wait; cat /tmp/o1 /tmp/o2 >> $L
fi
cp $OUT/bench.log /dev/null; cat $L
