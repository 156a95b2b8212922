# One step's generation as recipes/grpo.py draws it (rollouts.sample: a generator per row, KeyedSampling) beside
# transformers' own sampling (do_sample=True, as TRL's GRPOTrainer calls generate), on the LoRA-wrapped tiny Llama,
# alternating, same process: 8 rows x 64 new tokens, no stop token (min_new_tokens) so both draw the same count.
import json, statistics, sys, time
sys.path.insert(0, "recipes")
import torch
from accelerate import Accelerator
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, GenerationConfig
from common.model import modeling
from common.training import rollouts
torch.set_num_threads(int(sys.argv[1]))
acc = Accelerator(cpu=True)
tok = modeling.load_tokenizer("models/tiny-llama")
model = get_peft_model(AutoModelForCausalLM.from_pretrained("models/tiny-llama", dtype=torch.float32),
                       LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM"))
prompt = tok(json.loads(open("data/prompts/train.jsonl").readline())["prompt"])["input_ids"]
ids = [prompt] * 8
ours, theirs = [], []
for round_ in range(6):
    start = time.perf_counter()
    rollouts.sample(acc, model, ids, list(range(8)), max_new_tokens=64, stop_ids=[-1], pad_id=tok.pad_token_id)
    ours.append(time.perf_counter() - start)
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(input_ids=torch.tensor(ids), attention_mask=torch.ones(8, len(prompt), dtype=torch.long),
                       generation_config=GenerationConfig(max_new_tokens=64, min_new_tokens=64, do_sample=True,
                                                          temperature=1.0, top_k=0, pad_token_id=tok.pad_token_id))
    theirs.append(time.perf_counter() - start)
print(f"threads {sys.argv[1]}: recipe's sampler {statistics.median(ours[1:]):.3f} s, transformers' sampling "
      f"{statistics.median(theirs[1:]):.3f} s (medians of rounds 2-6; 8 rows x 64 tokens)")
