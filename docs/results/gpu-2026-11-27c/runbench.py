"""vpce.bench with vpce.gemm.DW_TILE from $DWT (tile_m,tile_n,cluster_m,cluster_n,pingpong,swap_ab), if set."""
import os, runpy, sys
if os.environ.get("DWT"):
    from vpce import gemm
    tm, tn, cm, cn, pp, sw = (int(x) for x in os.environ["DWT"].split(","))
    gemm.DW_TILE = dict(tile_m=tm, tile_n=tn, cluster_m=cm, cluster_n=cn, pingpong=bool(pp), swap_ab=bool(sw))
sys.argv = ["vpce.bench"] + sys.argv[1:]
runpy.run_module("vpce.bench", run_name="__main__")
