"""The OPD merge as Prefect flows: teacher servers up → distill the student → register it.

`distill_stage(ctx, ...)` is the pipeline's subflow (after the specialists, with the base checkpoint as the
student's start and {domain: specialist checkpoint dir}); domains in `teachers.external` use those URLs instead.
`distill(...)` is the same with plain JSON parameters: the `alloy-distill/default` deployment, which
`distill.mode: deployment` runs (`run_distill`) with storage URLs of the base and the teachers; its summary comes
back through storage (`<student prefix>/summary.json`), so the two flow runs need share no disk (flows/handoff.py).
"""
from __future__ import annotations

from prefect import flow

from flows.handoff import (DEPLOYMENT_POLL_S, dispatch_overrides, fetch_checkpoint, warn_unshared_storage,
                           where_am_i)
from infra.choices import StageMode
from infra.config import refuse_secret_overrides
from infra.storage import join, local_path, read_json, write_json
from tasks.context import RunContext, open_context, stage_timer
from tasks.distill import register_student, student_prefix, train_student
from tasks.teachers import serve_teachers


@flow(name="alloy-distill-stage", validate_parameters=False)
def distill_stage(ctx: RunContext, student_init: str, specialists: dict[str, str]) -> dict:
    """Returns the student summary: `student_dir`, `student_checkpoint`, `registered_model`, `n_teachers`,
    `throughput`, per-teacher totals and the in-training evals."""
    fleet = serve_teachers(ctx, specialists, student_init)
    try:
        student = train_student(ctx, student_init, fleet.endpoints())
        student["teacher_restarts"] = {s["name"]: s["restarts"] for s in fleet.status()}
    finally:
        fleet.stop()  # the teachers are only needed while the student trains
    student["n_teachers"] = len(fleet.endpoints())
    student["registered_model"] = register_student(ctx, student)
    return student


SUMMARY_FILE = "summary.json"  # the stage summary beside the student's final/, for a pipeline on another worker


def run_distill(ctx: RunContext, student_init: str, teachers: dict[str, str], base_url: str | None = None,
                teacher_urls: dict[str, str] | None = None) -> dict:
    """The pipeline's distill stage: `distill_stage` here (`distill.mode: local`), or a flow run of
    `distill.deployment` handed `base_url` and `teacher_urls` (storage URLs), its student pulled back from storage
    into this run's work dir. Returns the student summary either way (`student_dir` local to this run)."""
    if ctx.cfg.distill.mode != StageMode.DEPLOYMENT:
        return distill_stage(ctx, student_init, teachers)
    from prefect.deployments import run_deployment

    if not base_url or teacher_urls is None:
        raise ValueError("distill.mode=deployment needs storage URLs of the base checkpoint and the teachers")
    warn_unshared_storage(ctx, "distill.mode")
    with stage_timer(ctx, "distill"):
        fr = run_deployment(ctx.cfg.distill.deployment, timeout=None, as_subflow=True, poll_interval=DEPLOYMENT_POLL_S,
                            parameters={"config": ctx.config_path, "student_init": base_url, "teachers": teacher_urls,
                                        "overrides": dispatch_overrides(ctx), "parent_run_id": ctx.parent_run_id})
        if not fr.state or not fr.state.is_completed():
            raise RuntimeError(f"distill: deployment run {fr.id} ended {fr.state and fr.state.name}")
        prefix = student_prefix(ctx)
        summary = read_json(join(prefix, SUMMARY_FILE))
        summary["student_dir"] = fetch_checkpoint(summary["student_checkpoint"], ctx.work_dir / "student", "distill")
        summary["flow_run_id"] = str(fr.id)
    return summary


@flow(name="alloy-distill", log_prints=True)
def distill(config: str, student_init: str, teachers: dict[str, str], overrides: list[str] | None = None,
            parent_run_id: str | None = None) -> dict:
    """Distill `teachers` ({domain: specialist checkpoint}; domains in the config's `teachers.external` may be
    omitted) into a student started from `student_init`, for CONFIG. Checkpoints are storage URLs, pulled into
    this worker's work dir (a local directory also works on the machine that has it). The student's final/ and
    the stage summary (`summary.json`) are committed under the student's storage prefix. Logs under
    `parent_run_id` when given. Secrets are refused in `overrides`: the worker's environment carries them
    (ALLOY_ENGINE_API_KEY, ...)."""
    refuse_secret_overrides(overrides, "flow alloy-distill, parameter `overrides`")
    ctx = open_context(config, overrides or [], parent_run_id=parent_run_id, check_model_path=False)
    print(where_am_i("alloy-distill", ctx))
    status = "FAILED"
    try:
        init = fetch_checkpoint(student_init, ctx.work_dir / "student-init", "distill: student_init")
        pulled = {student_init: init}  # a URL handed for several domains (the base as their teacher) is pulled once
        local = {}
        for d, u in teachers.items():
            if u not in pulled:
                pulled[u] = fetch_checkpoint(u, local_path(ctx.work_dir, "teachers", d), f"distill: teacher {d}")
            local[d] = pulled[u]
        out = distill_stage(ctx, init, local)
        write_json(join(student_prefix(ctx), SUMMARY_FILE), {k: v for k, v in out.items() if k != "student_dir"})
        status = "FINISHED"
        return out
    finally:
        if parent_run_id is None:  # our own parent run; someone else's stays open for them
            ctx.tracker.end(status)
