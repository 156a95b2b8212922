# Greedy generation of the 128 held-out prompts as recipes/grpo.py's final evaluation does it (rollouts.sample,
# chunks of batch-size x grad-accum rows), beside larger chunks: seconds for all 128, one process.
import json, sys, time
sys.path.insert(0, "recipes")
import torch
from accelerate import Accelerator
from transformers import AutoModelForCausalLM
from common.model import modeling
from common.training import rollouts
torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
acc = Accelerator(cpu=True)
tok = modeling.load_tokenizer("models/tiny-llama")
model = AutoModelForCausalLM.from_pretrained("models/tiny-llama", dtype=torch.float32)
rows = [json.loads(l)["prompt"] for l in open("data/prompts/eval.jsonl")]
ids = [tok(r)["input_ids"] for r in rows]
stop = rollouts.stop_tokens(tok, model)
for chunk in (8, 32, 128, 8):
    start = time.perf_counter(); n = 0
    for i in range(0, len(ids), chunk):
        out = rollouts.sample(acc, model, ids[i:i + chunk], None, max_new_tokens=64, stop_ids=stop, pad_id=tok.pad_token_id)
        n += sum(map(len, out))
    print(f"chunk {chunk:4d}: {time.perf_counter() - start:6.2f} s for {len(ids)} prompts ({n} tokens)", flush=True)
