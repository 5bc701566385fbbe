"""A local HF causal-LM checkpoint as an MLflow model of the `transformers` flavor (a `text-generation` pipeline).

What `Tracker.register_model(..., flavor="transformers")` logs, so that
`mlflow.transformers.load_model("models:/alloy-student@candidate")` returns a working pipeline and
`mlflow.pyfunc.load_model` a string-in/string-out model. Saved with `mlflow.transformers.save_model` into a local
folder (no fluent run: the tracker logs the folder under the run it names), layout:
`MLmodel`, `model/` (config + safetensors), `components/tokenizer/`, `requirements.txt`, `model_card.md`.

Nothing here touches the network: the checkpoint is loaded from its absolute local path (an absolute path is no
valid Hub id, so MLflow's model-card and license look-ups cannot reach the Hub), the model card is ours, and the
pip requirements are pinned from the installed versions instead of being inferred (which would load the model again
in a subprocess). MLflow's path-only form (`save_model("<dir>", task=...)`, no load) fails with transformers 5 in
MLflow 3.x (`check_task` changed shape), so the model is loaded once, in the checkpoint's own dtype.
"""
from __future__ import annotations

import logging
import os
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

log = logging.getLogger("alloy.tracking")

TASK = "text-generation"
_PINNED = ("transformers", "torch", "tokenizers", "safetensors")


def pip_requirements() -> list[str]:
    """The installed versions of what loading the pipeline needs, without local labels ("2.3.0+cpu" → "2.3.0")."""
    out = []
    for pkg in _PINNED:
        try:
            out.append(f"{pkg}=={version(pkg).split('+')[0]}")
        except PackageNotFoundError:
            out.append(pkg)
    return out


def _model_card(description: str | None):
    from huggingface_hub import ModelCard

    meta = f"---\nlibrary_name: transformers\npipeline_tag: {TASK}\ntags:\n- alloy\n---\n"
    return ModelCard(meta + "# Alloy model\n\n" + (description or "A causal LM trained by Alloy.") + "\n")


def save_transformers_model(model_dir: str | os.PathLike, out_dir: str | os.PathLike,
                            description: str | None = None) -> Path:
    """Save the HF checkpoint `model_dir` (config, weights, tokenizer) as an MLflow transformers model in `out_dir`
    (which must not exist). Raises (ValueError/OSError/MlflowException) when it is not a loadable causal LM."""
    import mlflow.transformers
    from transformers import AutoModelForCausalLM

    from infra.models import load_tokenizer

    src = Path(model_dir).resolve()  # absolute: never mistaken for a Hub repo id
    if not (src / "config.json").is_file():
        raise ValueError(f"{src} has no config.json: not a Hugging Face checkpoint")
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype="auto")
    model.eval()
    tok = load_tokenizer(src)
    out = Path(out_dir)
    mlflow.transformers.save_model({"model": model, "tokenizer": tok}, str(out), task=TASK,
                                   pip_requirements=pip_requirements(), model_card=_model_card(description))
    # MLflow writes a Hub-license note naming the local path; the license is the base checkpoint's, say so instead
    (out / "LICENSE.txt").write_text("The license of this model is that of the checkpoint it was trained from "
                                     "(the run's `model.path`).\n", encoding="utf-8")
    return out
