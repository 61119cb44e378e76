"""The RL trainer: GRPO family, KL estimators, tasks (issue: RL)."""
