import gc, json, os, sys, time, tracemalloc
sys.path.insert(0, sys.argv[1])
import datasets, numpy as np, pyarrow as pa
from common.data import tokens
datasets.disable_progress_bars()
rows = int(sys.argv[2]); path = f"{sys.argv[3] if len(sys.argv) > 3 else '/tmp'}/report-{rows}.arrow"
if not os.path.exists(path):
    rng = np.random.default_rng(0)
    too_long = rng.random(rows) < 0.02
    dropped = pa.array(np.where(too_long, "too long", ""))
    table = pa.table({"input_ids": pa.array([[1, 2, 3]] * 1) .take(pa.array(np.zeros(rows, dtype=np.int64))),
                      "dropped": dropped, "needs": pa.array(rng.integers(50, 2000, rows)),
                      "cut": pa.array(rng.random(rows) < 0.01), "eos_added": pa.array(np.zeros(rows, bool)),
                      "stops": pa.array([["</s>"]] * 1).take(pa.array(np.zeros(rows, dtype=np.int64))),
                      "boundary": pa.array(np.zeros(rows, bool))})
    with pa.OSFile(path, "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table, max_chunksize=1000)
ds = datasets.Dataset.from_file(path)
out = {}
for name, work in [("counted", lambda: tokens.counted(ds)), ("kept_rows", lambda: tokens.kept_rows(ds))]:
    pool = pa.default_memory_pool(); base = pool.bytes_allocated()
    gc.collect(); tracemalloc.start(); t = time.perf_counter()
    result = work()
    out[name] = {"s": round(time.perf_counter() - t, 2), "peak_mib": round(tracemalloc.get_traced_memory()[1] / 2**20, 1)}
    tracemalloc.stop()
    if name == "counted": out["line"] = result
    else: out["kept"] = len(result)
print(json.dumps(out)); sys.stdout.flush(); os._exit(0)
