"""The specialists: one RL-trained expert per domain, whose checkpoints the OPD stage serves as its teachers (hence
the name; `docs/architecture.md`, "Critic-based PPO").

- `specialist_main.py`: one specialist as a process (its ranks, engine server, event loop); `specialist.py`: its
  trainer (rollout → PPO update → weight push → validation, per step);
- `ppo_step.py`: one PPO update on a batch; `ppo_math.py`: the pure math (GAE, clipped losses, KL, TIS);
  `critic.py`: the value model;
- `rollout.py`: a rollout step through the engine server (episodes from `domains.episodes`), `april.py`: active
  partial rollouts, `compaction.py`: long episodes cut into sub-traces;
- `selection.py`: validation, best-step selection, early stop; `guard.py` / `judge_model.py`: the anti-hack judge;
  `mixed_domain.py`: several domains behind one (the mixed-RL baseline); `registry.py`: domain → teacher endpoint.
"""
