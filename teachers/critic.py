"""The PPO critic: a causal-LM backbone (same architecture as the policy) with a scalar value head.

    values = Linear(hidden, 1)(backbone(input_ids).last_hidden_state).squeeze(-1)          (B, T, H) → (B, T)

The head starts at zero (weight and bias), so the untrained critic predicts V = 0 everywhere: the first GAE
advantages are then the plain (discounted) returns, instead of the noise of a random head. The backbone starts from
the policy/base checkpoint (`from_pretrained`), which is what GLM/verl/OpenRLHF do: the critic reads the same
features the policy does. Value at position t is V(prefix input_ids[:, :t+1]), i.e. the value of the state in which
the token at t+1 is chosen (the alignment of `teachers.ppo_step`).

On disk (`save` / `load`): `config.json` (the backbone's HF config) + `value_model.safetensors` (backbone + head).
"""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoConfig, AutoModel, PretrainedConfig

from infra.models import model_config, placement_kwargs

WEIGHTS_NAME = "value_model.safetensors"


class ValueModel(nn.Module):
    """Backbone (an HF base model such as LlamaModel: returns `last_hidden_state`) + zero-initialised value head."""

    def __init__(self, backbone: nn.Module):
        super().__init__()
        self.backbone = backbone
        self.config: PretrainedConfig = backbone.config
        self.value_head = nn.Linear(self.config.hidden_size, 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, attention_mask (B, T) → values (B, T) (float32 whatever the backbone dtype)."""
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        return self.value_head(hidden.to(self.value_head.weight.dtype)).squeeze(-1).float()

    # ---- construction -----------------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, model_dir: str | Path, dtype: torch.dtype = torch.float32,
                        device: str | torch.device | None = None) -> "ValueModel":
        """Backbone weights from an HF causal-LM dir (the policy/base checkpoint), read onto `device` (None: the
        host); the LM head is dropped."""
        backbone = AutoModel.from_pretrained(str(model_dir), dtype=dtype, **placement_kwargs(device))
        return cls(backbone)

    @classmethod
    def from_preset(cls, preset: str, vocab_size: int, pad_id: int, bos_id: int, eos_id: int,
                    seed: int = 0) -> "ValueModel":
        """A freshly initialised backbone of an `infra.models` preset (tests; real runs use `from_pretrained`)."""
        torch.manual_seed(seed)
        return cls(AutoModel.from_config(model_config(preset, vocab_size, pad_id, bos_id, eos_id)))

    # ---- persistence ------------------------------------------------------------------------------------------
    def save(self, out_dir: str | Path) -> Path:
        """Write config.json + value_model.safetensors to `out_dir` (created). Returns the dir."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.config.save_pretrained(str(out))
        # contiguous CPU copies: safetensors refuses views and shared storage
        state = {k: v.detach().to("cpu").contiguous().clone() for k, v in self.state_dict().items()}
        save_file(state, str(out / WEIGHTS_NAME))
        return out

    @classmethod
    def load(cls, model_dir: str | Path) -> "ValueModel":
        """Inverse of `save`: rebuild the backbone from config.json and load every tensor (strictly)."""
        src = Path(model_dir)
        weights = src / WEIGHTS_NAME
        if not weights.is_file():
            raise FileNotFoundError(f"ValueModel.load: {weights} missing (not a dir written by ValueModel.save?)")
        config = AutoConfig.from_pretrained(str(src))
        model = cls(AutoModel.from_config(config))
        state = load_file(str(weights))
        missing, unexpected = model.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(f"ValueModel.load: {weights} does not match the config: missing={missing}, "
                             f"unexpected={unexpected}")
        return model
