"""A submission's Bridge side: the request bound and planned, the run directory written and the run plugins made, for
cluster/submit.py to check, mark and queue (it reads the plan as a record and never imports Bridge).

The one home of binding a request to where it runs: make plan (CLUSTER's profile), make submit/sbatch (the profile),
make run-local (this node) and the nightly bind here; the job rebuilds the bound request from overrides.json
(bridge/request.py from_record) and never binds again.
"""

from __future__ import annotations

import dataclasses
import functools

from overlapkit import names, paths
from overlapkit.bridge import registry, stack
from overlapkit.bridge.build import Plan, plan_for, write_run_dir
from overlapkit.bridge.request import loose
from overlapkit.cluster import submit
from overlapkit.cluster.profiles import load_profile
from overlapkit.spec import request, runopts
from overlapkit.spec.profile import ClusterProfile
from overlapkit.spec.request import PlanRequest
from overlapkit.spec.topology import GPUS_PER_NODE


def bind(req: PlanRequest, profile: ClusterProfile) -> PlanRequest:
    """The request on this cluster: its job directory, the per-segment time limit (profile, else recipe), its W&B
    project. The recipe's limit is looked up even when the profile has one: an unknown recipe is that error first."""
    return request.bind(req, profile.resolved(), registry.get(req.recipe).time_limit)


def prepare(recipe: str, cluster, *, nodes=None, sets="", run=None, **kwargs) -> submit.Submission:
    """`submission` for a request made of loose values (the nightly, tests): `cluster` a profile name, path or
    ClusterProfile; `run` the unbound run options (RUN_NAME, SEGMENTS, NSYS, DATA); the rest submission's keywords."""
    profile = cluster if isinstance(cluster, ClusterProfile) else load_profile(cluster)
    return submission(bind(loose(recipe, nodes, sets, run), profile), profile, **kwargs)


def submission(
    req: PlanRequest,
    profile: ClusterProfile,
    *,
    preflight_only=False,
    checks="full",
    caller_env=None,
    check_partition=False,
    dry=False,
) -> submit.Submission:
    """Plan the request (bound to `profile` by `bind`) for `profile`, refuse what cluster/submit.py `accepted`
    refuses, then write the run directory (`dry`: a dry run's, under the checkout's runs/)."""
    plan = plan_for(dataclasses.replace(req, cluster=profile.resolved(laid_out=True)), caller_env=caller_env)
    where = submit.accepted(
        plan,
        profile,
        preflight_only=preflight_only,
        caller_env=caller_env,
        check_partition=check_partition,
        dry=dry,
        imports=stack.training_import_problem,
    )
    run_dir = write_run_dir(plan, names.inside(where.job_path, "runs"))
    plugins = functools.partial(plugins_for, plan)  # made where a job is: nemo_run is imported only there
    return submit.opened(plan, where, run_dir, preflight_only, checks, plugins)


def run_local(plan: Plan, *, preflight_only: bool = False, checks: str = "full", dryrun=False):
    """make run-local: the run directory under runs/local, then one 8-GPU node with torchrun through nemo_run's
    LocalExecutor (no Slurm); returns the directory."""
    import nemo_run as run

    run_dir = write_run_dir(plan, submit.local_runs())
    executor = run.LocalExecutor(ntasks_per_node=GPUS_PER_NODE, launcher="torchrun")
    # This checkout, by absolute path: torchx's local scheduler runs the script from its own working directory.
    script, args = str(paths.REPO_ROOT / submit.ENTRY), submit.entry_args(plan, run_dir, preflight_only, checks)
    with run.Experiment(plan.recipe.name, executor=executor, log_level="ERROR") as exp:
        exp.add(run.Script(path=script, args=args, entrypoint="python"), name="train", plugins=plugins_for(plan))
        exp.dryrun(log=True) if dryrun else exp.run(sequential=True, tail_logs=True)
    return run_dir


def plugins_for(plan: Plan) -> list:
    """Our env-var plugin, and Bridge's PreemptionPlugin where the run saves checkpoints (it appends its overrides to
    the script's arguments and sets --signal). NSYS needs none: launch/entry.py runs each profiled rank under nsys."""
    from megatron.bridge.recipes.run_plugins import PreemptionPlugin

    from overlapkit.bridge.plugin import EnvVarPlugin

    out = [EnvVarPlugin(env=plan.ledger.values())]
    if plan.run.run_name:
        out.append(PreemptionPlugin(preempt_time=runopts.PREEMPT_S))
    return out


def recipe_names() -> list[str]:
    """Every registered recipe: a night's default suite."""
    return registry.names()


def check_recipes(names: list[str]) -> None:
    """Unknown recipe names fail before anything is submitted or scheduled (not at 02:00); needs the registry, so
    Bridge."""
    stack.import_bridge()
    for name in names:
        registry.get(name)


def layout_of(name: str) -> dict:
    """The recipe's layout as the nightly shapes it (nightly/nightly.py shape_for), from its built config."""
    entry = registry.get(name)
    with stack.silenced():
        cfg = entry.build()
    m = cfg.model
    return {
        "tp": m.tensor_model_parallel_size,
        "pp": m.pipeline_model_parallel_size,
        "cp": m.context_parallel_size or 1,
        "mbs": cfg.train.micro_batch_size,
        "gbs": cfg.train.global_batch_size,
        "nodes": entry.nodes,
        "ep": m.expert_model_parallel_size or 1,
        "etp": m.expert_tensor_parallel_size or 1,
    }
