"""The run layer: the one place that wires envs, agents and algorithms.

config (YAML + presets), policy (model, reference, value model, optimizers), learner (the LLM
`Learner`), collection (rollouts with retries), trainer (the loop), checkpoint (save, resume,
Hugging Face export), evaluation (avg@k / pass@k), compare (several algorithms side by side)
and cli (`seeupo-train`, `seeupo-eval`, `seeupo-export`).
"""
