"""The plain-sbatch path: a standalone script from the same plan and ledger, for login nodes without nemo_run.

It runs the repository checkout in place (`--chdir`), so that checkout must be on the shared filesystem.
"""

from __future__ import annotations

import shlex
from string import Template

from overlapkit import jsonio, paths
from overlapkit.cluster import slurm
from overlapkit.cluster.submit import Submission
from overlapkit.spec import runopts
from overlapkit.spec.runopts import PREEMPT_S
from overlapkit.spec.topology import GPUS_PER_NODE

TEMPLATE = paths.REPO_ROOT / "slurm" / "templates" / "pretrain.sbatch"


def render(sub: Submission) -> str:
    p, plan = sub.profile, sub.plan
    by_name = {e.name: e for e in plan.ledger.entries}
    exports = "\n".join(
        f"export {name}={shlex.quote(value)}  # {by_name[name].layer}: {by_name[name].reason}"
        for name, value in plan.ledger.values().items()
    )
    nsys = "# (no NSYS: no Nsight Systems profile)"
    if plan.run.nsys:  # launch/entry.py runs the profiled ranks under nsys itself (overlapkit/profile/profiled.py)
        (a, b), ranks = plan.run.nsys, ",".join(map(str, plan.run.nsys_ranks))
        nsys = (
            f"# NSYS={a}:{b} NSYS_RANKS={ranks}: launch/entry.py runs those ranks under nsys profile and exports each "
            f"report: {sub.run_dir / runopts.NSYS_DIR}/rank<R>.{{nsys-rep,sqlite}}, then "
            f"{sub.run_dir}/{{{runopts.OVERLAP_JSON},{runopts.OVERLAP_PNG}}}"
        )
    srun = list(p.srun_args)
    if p.container_image:  # pyxis: the image, the mounts, and the checkout itself at the same path
        mounts = [*p.container_mounts, f"{paths.REPO_ROOT}:{paths.REPO_ROOT}", f"{sub.run_dir}:{sub.run_dir}"]
        srun += [f"--container-image={p.container_image}", f"--container-mounts={','.join(mounts)}"]
    return Template(TEMPLATE.read_text()).substitute(
        recipe=plan.recipe.name,
        cluster=p.name,
        run_dir=sub.run_dir,
        account=p.account,
        partition=p.partition,
        nodes=plan.target.nodes,
        tasks_per_node=GPUS_PER_NODE,
        gpus_per_node=p.gpus_per_node,
        time=p.time_limit or plan.recipe.time_limit,
        exclusive="#SBATCH --exclusive" if p.exclusive else "# (shared nodes: exclusive = false in the profile)",
        # What Bridge's PreemptionPlugin sets on the nemo_run path: SIGTERM before the limit, a checkpoint, an exit.
        signal=f"#SBATCH --signal=TERM@{PREEMPT_S}"
        if plan.run.run_name
        else "# (no RUN_NAME: no checkpoints, so no --signal=TERM@<s> to save one before the time limit)",
        nsys=nsys,
        secrets=" " + ", ".join(plan.ledger.secrets) if plan.ledger.secrets else " none",
        export=slurm.export_list(plan.ledger.secrets),
        step_export="\n".join(f"export {k}={v}" for k, v in slurm.STEP_EXPORT.items()),
        exports=exports,
        srun_args=shlex.join(srun),
        code_dir=shlex.quote(str(paths.REPO_ROOT)),
        claim=shlex.quote(f"{sub.command} --claim"),
        command=shlex.quote(sub.command),
    )


def write(sub: Submission) -> str:
    return str(jsonio.write_text(sub.run_dir / "sbatch.sh", render(sub), mode=0o755))
