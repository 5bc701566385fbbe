"""The TRL side of bench/trl_compare.py: TRL 1.16's `GKDTrainer` (several domains, a routed teacher) and
`DistillationTrainer` (one domain), fed exactly the prompts Alloy's trainer draws, with the bench's spec (see
trl_compare's docstring: forced lengths, beta = 1, equal steps). Each returns (trained model, stats)."""
from __future__ import annotations

import time
from pathlib import Path

from harness import own_cpu_s


def phase_timers(student, teacher_parts: list) -> dict:
    """Time TRL's phases as Alloy's trainer reports its own: `sample_s` (the student's `generate`), `score_s` (the
    teacher's forward: each module of `teacher_parts` counted at the outermost call, so a part called from another
    is not counted twice); the caller sets `train_s` = the loop's wall − both (the student's forward and backward,
    the optimizer and the rest). Instance attributes wrap the bound methods, so every call through the trainer
    counts. DistillationTrainer runs the teacher's backbone (`.model`) and applies its LM head chunk by chunk inside
    the loss: that head is in `train_s`."""
    box = {"sample_s": 0.0, "score_s": 0.0}
    depth = {"sample_s": 0, "score_s": 0}

    def wrap(obj, name: str, key: str) -> None:
        inner = getattr(obj, name)

        def timed(*a, **k):
            depth[key] += 1
            t = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                depth[key] -= 1
                if depth[key] == 0:
                    box[key] += time.perf_counter() - t

        setattr(obj, name, timed)

    wrap(student, "generate", "sample_s")
    for part in teacher_parts:
        wrap(part, "forward", "score_s")
    return box


def cpu_marks(trainer) -> dict:
    """CPU seconds (this process, every thread: TRL is one process) and completion tokens after the first optimizer
    step and at the end, so the CPU per token covers steps 2..N on every side (Alloy's first step also starts its
    servers' lazy work)."""
    from transformers import TrainerCallback

    marks: dict = {}

    class Mark(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step in (1, state.max_steps):
                marks[state.global_step] = (own_cpu_s(), trainer.completion_tokens)

    trainer.add_callback(Mark())
    return marks


def cpu_window(marks: dict, first: int, last: int, system: str) -> tuple[float, int]:
    """(CPU seconds, completion tokens) between the marks taken after step `first` and after step `last`; a run that
    ended before its last step (or ran one step) has no window: a clear error, not a KeyError."""
    missing = [s for s in (first, last) if s not in marks]
    if missing or first >= last:
        raise RuntimeError(f"{system}: no CPU window over steps {first + 1}..{last}: marks taken after steps "
                           f"{sorted(marks)} (the run ended early, or has fewer than 2 steps)")
    (c1, n1), (c2, n2) = marks[first], marks[last]
    return c2 - c1, n2 - n1


def timed_train(trainer, student, teacher_parts: list) -> dict:
    """`trainer.train()` with its phases (`phase_timers`) and CPU per token (`cpu_marks`) measured: the stats every
    TRL system returns (the caller adds the model)."""
    phases, marks = phase_timers(student, teacher_parts), cpu_marks(trainer)
    t = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t
    steps = trainer.state.global_step
    cpu, tokens = cpu_window(marks, 1, trainer.state.max_steps, type(trainer).__name__)
    return {"train_wall_s": wall, "steps": steps, "completion_tokens": trainer.completion_tokens,
            "timing_s": {**phases, "train_s": wall - phases["sample_s"] - phases["score_s"]},
            "train_cpu_s": cpu, "cpu_tokens": tokens}


def prompt_ids(tok, prompt: str) -> list[int]:
    return [tok.bos_token_id] + tok(prompt, add_special_tokens=False).input_ids


def prompt_rows(domains: dict, tok, spec: dict, seed: int) -> list:
    """The exact prompt sequence Alloy's trainer draws: `steps` takes of `batch` from its seeded PromptStream."""
    from student.sampler import PromptStream

    stream = PromptStream(domains, tok, spec["n_prompts_per_domain"], seed)
    return [it for _ in range(spec["steps"]) for it in stream.take(spec["batch"])]


def trl_args(cls, spec: dict, seed: int, out_dir: Path, **extra):
    return cls(output_dir=str(out_dir), per_device_train_batch_size=spec["batch"], gradient_accumulation_steps=1,
               max_steps=spec["steps"], learning_rate=spec["lr"], lr_scheduler_type="constant", warmup_steps=0,
               weight_decay=0.0, max_grad_norm=1.0, optim="adamw_torch", seed=seed, report_to="none",
               save_strategy="no", logging_steps=10 ** 6, disable_tqdm=True,
               # spec["cuda"] (bench/gpu_perf.py's TRL part): on the GPU in bf16 autocast, as a user would run it
               use_cpu=not spec.get("cuda", False), bf16=bool(spec.get("cuda", False)),
               dataloader_num_workers=0, **extra)


def run_gkd(spec: dict, names: list[str], seed: int, work: Path):
    import torch
    from datasets import Dataset
    from torch.utils.data import SequentialSampler
    from transformers.modeling_outputs import CausalLMOutput
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    from domains.registry import load_domain
    from infra.models import load_model, load_tokenizer

    tok = load_tokenizer(spec["base"])
    domains = {d: load_domain(d) for d in names}
    rows = [{"prompt_ids": it.prompt_ids, "domain_idx": names.index(it.domain)}
            for it in prompt_rows(domains, tok, spec, seed)]

    class RoutedTeacher(torch.nn.Module):
        """One teacher per domain; row b goes to teachers[route[b]] (set by the trainer before each forward)."""

        def __init__(self, teachers):
            super().__init__()
            self.teachers = torch.nn.ModuleList(teachers)
            self.config = teachers[0].config
            self.route = None

        def forward(self, input_ids, attention_mask):
            logits = None
            for k, t in enumerate(self.teachers):
                rows_k = (self.route == k).nonzero().squeeze(-1)
                if rows_k.numel() == 0:
                    continue
                lk = t(input_ids=input_ids[rows_k], attention_mask=attention_mask[rows_k]).logits
                if logits is None:
                    logits = lk.new_zeros(input_ids.shape + (lk.shape[-1],))
                logits[rows_k] = lk
            return CausalLMOutput(logits=logits)

    def collate(batch):
        pid = [b["prompt_ids"] for b in batch]
        T = max(map(len, pid))
        ids = torch.full((len(pid), T), tok.pad_token_id, dtype=torch.long)
        am = torch.zeros_like(ids)
        for i, r in enumerate(pid):  # left-padded prompts for generate
            ids[i, T - len(r):], am[i, T - len(r):] = torch.tensor(r), 1
        # no "labels": GKD makes them after generation; with labels of prompts only, num_items_in_batch would be 0
        return {"prompts": ids, "prompt_attention_mask": am, "input_ids": ids.clone(), "attention_mask": am.clone(),
                "domain_idx": torch.tensor([b["domain_idx"] for b in batch])}

    class RoutedGKD(GKDTrainer):
        completion_tokens = 0

        def _get_train_sampler(self, train_dataset=None):
            return SequentialSampler(train_dataset if train_dataset is not None else self.train_dataset)

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            self.accelerator.unwrap_model(self.teacher_model).route = inputs["domain_idx"]
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

        def training_step(self, model, inputs, num_items_in_batch=None):
            if spec["force"]:  # the Trainer copies the tokenizer's EOS into the model's generation config at
                # train start, and generate merges it into ours: drop it before every generation
                self.accelerator.unwrap_model(model).generation_config.eos_token_id = None
            loss = super().training_step(model, inputs, num_items_in_batch)
            self.completion_tokens += int((inputs["labels"] != -100).sum())  # generated tokens up to EOS
            return loss

    student = load_model(spec["base"])
    if spec["force"]:  # no EOS id: generate runs max_new_tokens, the completion mask keeps every token
        student.generation_config.eos_token_id = None  # (also in training_step: the Trainer sets it again)
    teacher = RoutedTeacher([load_model(spec["teachers"][d]) for d in names])
    # GKDConfig inherits SFTConfig's gradient_checkpointing=True, and GKDTrainer then generates with
    # use_cache=False (no KV cache): off, as for DistillationTrainer, the peer at its fastest (TRL's docs: gradient
    # checkpointing trades speed for memory)
    args = trl_args(GKDConfig, spec, seed, work / "gkd", lmbda=1.0, beta=1.0, temperature=1.0,
                    max_new_tokens=spec["max_new_tokens"], gradient_checkpointing=False, disable_dropout=True)
    trainer = RoutedGKD(model=student, teacher_model=teacher, args=args, data_collator=collate,
                        train_dataset=Dataset.from_list(rows), processing_class=tok)
    if spec["force"]:
        trainer.generation_config.eos_token_id = None
    stats = timed_train(trainer, student, [teacher])
    return trainer.model, stats


def run_trl_distill(spec: dict, names: list[str], seed: int, work: Path):
    from datasets import Dataset
    from trl import DistillationConfig, DistillationTrainer

    from domains.registry import load_domain
    from infra.models import load_model, load_tokenizer

    tok = load_tokenizer(spec["base"])
    domains = {d: load_domain(d) for d in names}
    rows = [{"prompt": it.example.prompt} for it in prompt_rows(domains, tok, spec, seed)]
    # the tokenizer adds BOS itself: tok(text=p) == [bos] + chars == Alloy's prompt ids
    assert tok(text=[rows[0]["prompt"]])["input_ids"][0] == prompt_ids(tok, rows[0]["prompt"])

    class CountingDistill(DistillationTrainer):
        completion_tokens = 0

        def _generate_and_score_completions(self, inputs):
            if spec["force"]:  # as in run_gkd: the Trainer puts the tokenizer's EOS back into the model's config
                self.accelerator.unwrap_model(self.model).generation_config.eos_token_id = None
            out = super()._generate_and_score_completions(inputs)
            self.completion_tokens += int(out["completion_mask"].sum())
            return out

    args = trl_args(DistillationConfig, spec, seed, work / "dt", beta=1.0, temperature=1.0, top_k=0, top_p=1.0,
                    max_completion_length=spec["max_new_tokens"], shuffle_dataset=False,
                    gradient_checkpointing=False, disable_dropout=True)
    student = load_model(spec["base"])
    if spec["force"]:
        student.generation_config.eos_token_id = None
    teacher = load_model(spec["teachers"][names[0]])
    trainer = CountingDistill(model=student, teacher_model=teacher,
                              args=args, train_dataset=Dataset.from_list(rows), processing_class=tok)
    if spec["force"]:  # the trainer adds the tokenizer's EOS to its stop ids and completion-mask ids: drop them all
        trainer.eos_token_ids = []
        trainer.generation_config.eos_token_id = None
        trainer.generation_kwargs["eos_token_id"] = None
    stats = timed_train(trainer, student, [teacher, teacher.model])  # the trainer calls the backbone itself
    return trainer.model, stats
