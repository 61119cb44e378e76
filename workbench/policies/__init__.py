"""Starting policies of RL runs: `selftrained.py` trains a small model and its digit-level tokenizer on the
arithmetic task without downloads; `warmstart.py` fine-tunes a pretrained policy on a task's own right answers until
its sampled reward leaves room for RL. Both save a Hugging Face checkpoint that a run starts from."""
