"""Starting accuracy of SmolLM2-135M-Instruct on candidate RL tasks (CPU, transformers, sampled at T=1 and greedy)."""
import random, sys, time, json
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
sys.path.insert(0, "/work/main")
from workbench.rl.answers import lenient_correct, extract_answer
from workbench.rl.tasks import GSM8K, PROMPT_TEMPLATE
torch.set_num_threads(2)
path = "/root/.cache/workbench/models/smollm2-135m-instruct"
tok = AutoTokenizer.from_pretrained(path); tok.padding_side = "left"
model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
N = int(sys.argv[2]) if len(sys.argv) > 2 else 48
rng = random.Random(0)
def arith(kind):
    out = []
    for _ in range(N):
        if kind == "add2":   # two 2-digit numbers
            a, b = rng.randint(10, 99), rng.randint(10, 99); out.append((f"What is {a} + {b}?", str(a + b)))
        elif kind == "mul1":
            a, b = rng.randint(2, 9), rng.randint(2, 9); out.append((f"What is {a} times {b}?", str(a * b)))
        elif kind == "mix1":  # a op b single digits
            a, b, op = rng.randint(0, 9), rng.randint(0, 9), rng.choice("+-*")
            out.append((f"What is {a} {op} {b}?", str(eval(f"{a}{op}{b}"))))
        elif kind == "add3":  # three 1-2 digit
            a, b, c = rng.randint(1, 20), rng.randint(1, 20), rng.randint(1, 20)
            out.append((f"What is {a} + {b} + {c}?", str(a + b + c)))
        elif kind == "word":  # one-step word problems
            a, b = rng.randint(2, 20), rng.randint(2, 20)
            out.append((f"Tom has {a} apples and buys {b} more. How many apples does he have now?", str(a + b)))
    return out
kind = sys.argv[1]
suffix = "\nAnswer step by step, then give the final number after '####'."
if kind == "gsm8k":
    g = GSM8K("/work/shared/data/gsm8k", "test")
    probs = [(p.prompt, p.answer) for p in g.items[:N]]
else:
    probs = [(q + suffix, a) for q, a in arith(kind)]
res = {}
for mode in ("greedy", "sampled"):
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False) for q, _ in probs]
    t = time.time(); correct = strict = 0; lens = []
    for i in range(0, len(prompts), 16):
        enc = tok(prompts[i:i+16], return_tensors="pt", padding=True)
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=160, do_sample=mode == "sampled", temperature=1.0, top_k=0, top_p=1.0, pad_token_id=tok.pad_token_id)
        for j, o in enumerate(out):
            text = tok.decode(o[enc.input_ids.shape[1]:], skip_special_tokens=True)
            ans = probs[i + j][1]
            correct += lenient_correct(text, ans); strict += extract_answer(text, "strict") == ans
            lens.append(int((o[enc.input_ids.shape[1]:] != tok.pad_token_id).sum()))
            if i == 0 and j < 2: print(mode, repr(text[:300]), ans, flush=True)
    res[mode] = dict(lenient=correct / len(probs), strict=strict / len(probs), mean_len=sum(lens) / len(lens), s=time.time() - t)
    print(kind, mode, res[mode], flush=True)
json.dump(res, open(f"/tmp/taskm/{kind}.json", "w"))
