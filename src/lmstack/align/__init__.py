"""Post-training (CS336 notes "模型对齐：RL 后训练微调"): supervised fine-tuning, preference optimisation and RL with
verifiable rewards, with rollouts on lmstack's own engine.

``losses`` holds every objective as a pure function on log-probabilities (SFT, DPO/IPO/robust/hinge,
Bradley–Terry, policy gradient with PPO/GRPO/dual clip, advantages, aggregation, KL estimators); docs/align.md.
"""
