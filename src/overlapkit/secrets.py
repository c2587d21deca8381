"""The one rule for credentials, for every way a value arrives: a make variable (SET, RUN_NAME, DATA, NAME, ... and
every other option of our entry points: launch/args.py), a cluster profile (its [env], srun_args and every string:
cluster/profiles.py), a layer of the launch environment (bridge/env.py build_ledger) and the caller's environment (the
NCCL_*-style variables the env ledger records: bridge/env.py). A credential is never written to a file of ours
(plan.json, ledger.json, overrides.json, the sbatch script, submission.json, the logs we write) nor printed: where it
arrives it is refused in one line that names where it was and the fix (FIX), never its value. A secret travels by
name only: a profile lists it (`secrets = ["WANDB_API_KEY"]`), the submitting shell exports it, and sbatch
(--export=PATH,<its name>: cluster/slurm.py export_list) hands it to the job; the ledger says "<from caller env>".

Which names count (`is_secret`): KEY, TOKEN (not TOKENS, a count), SECRET, PASS, CREDENTIAL anywhere in the name.

Which values count whatever their name (`credential_kind`): the documented shapes below, each the issuer's own prefix
or format, so that a value under an innocuous name (`[env] NCCL_HINT = "xoxb-..."`) is caught too. What does not
count, and why: a generic "long high-entropy string". A content digest, a git commit (40 hex characters: the shape
of a W&B key, whose rule is kept since a commit has no business in a launch variable), a UUID or a base64 config
blob look the same as a key by entropy alone, and refusing those would refuse real plans; nothing shapeless is
caught by value, which is what the name rule is for. Azure's and many vendors' plain API keys (32 hex characters,
say) have no shape of their own either; Azure's storage connection strings and SAS URLs do, and are listed.
"""

from __future__ import annotations

import re

# Anywhere in the name: WANDB_APIKEY, MY_TOKEN_FILE and DB_PASSWD are as secret as WANDB_API_KEY or HF_TOKEN.
# TOKENS (a count, e.g. HybridEP's NUM_OF_TOKENS_PER_CHUNK_COMBINE_API) is not a credential.
_SECRET = re.compile(r"KEY|TOKEN(?!S)|SECRET|PASS|CREDENTIAL", re.IGNORECASE)
# kind -> its shape; the source of each format in the comment beside it.
CREDENTIAL_FORMATS = {
    "a Hugging Face token": r"\bhf_[A-Za-z0-9]{30,}",  # huggingface.co/docs/hub/security-tokens
    "a W&B API key": r"(?<![0-9a-f])[0-9a-f]{40}(?![0-9a-f])",  # wandb.ai/authorize: 40 hex characters
    # github.blog/2021-04-05-behind-githubs-new-authentication-token-formats (ghp_ gho_ ghu_ ghs_ ghr_, github_pat_)
    "a GitHub token": r"\b(gh[pousr]_[A-Za-z0-9]{30,}|github_pat_[A-Za-z0-9_]{40,})",
    "a GitLab token": r"\bgl(pat|dt|rt|ptt|cbt|oas)-[A-Za-z0-9_\-]{20,}",  # docs.gitlab.com/security/tokens
    "an AWS access key": r"\b(AKIA|ASIA)[0-9A-Z]{16}\b",  # docs.aws.amazon.com IAM "Unique identifiers"
    "a Google Cloud API key": r"\bAIza[0-9A-Za-z_\-]{35}",  # cloud.google.com/docs/authentication/api-keys
    "a Google OAuth access token": r"\bya29\.[0-9A-Za-z_\-]{20,}",  # developers.google.com/identity (ya29. tokens)
    "an NVIDIA NGC key": r"\bnvapi-[A-Za-z0-9_\-]{20,}",  # docs.nvidia.com/ngc: personal keys start with nvapi-
    "an Anthropic API key": r"\bsk-ant-[A-Za-z0-9_\-]{20,}",  # docs.anthropic.com: keys start with sk-ant-
    "an OpenAI-style key": r"\bsk-[A-Za-z0-9_\-]{20,}",  # platform.openai.com/api-keys: sk-, sk-proj-
    # docs.slack.dev/authentication/tokens: bot xoxb-, user xoxp-, app xoxa-, refresh xoxr-, configuration xoxe-,
    # session xoxc-/xoxd-, legacy xoxs-/xoxo-; app-level xapp-; incoming webhooks hooks.slack.com/services/...
    "a Slack token": r"\b(xox[abcdeoprs]|xapp)-[A-Za-z0-9\-]{10,}|hooks\.slack\.com/services/[A-Za-z0-9/]{20,}",
    # RFC 7519 (JWT) in RFC 7515's compact form: base64url(header).base64url(payload).base64url(signature), the
    # header a JSON object, so it begins `{"` = eyJ (Azure AD, W&B service accounts, NGC and most OIDC tokens)
    "a JSON Web Token": r"\beyJ[A-Za-z0-9_\-]{5,}\.[A-Za-z0-9_\-]{5,}\.[A-Za-z0-9_\-]*",
    "a PyPI token": r"\bpypi-AgE[A-Za-z0-9_\-]{20,}",  # pypi.org/help/#apitoken: pypi- then a macaroon (AgE...)
    # learn.microsoft.com/azure/storage/common/storage-configure-connection-string and .../storage-sas-overview
    "an Azure key": r"\b(AccountKey|SharedAccessKey)=[A-Za-z0-9+/=]{20,}|[?&]sig=[A-Za-z0-9%+/=]{20,}",
    "a password in a URL": r"\b[a-z][a-z0-9+.\-]*://[^/\s:@]+:[^/\s@]+@",  # RFC 3986 userinfo (user:password@)
    "a private key": r"-----BEGIN [A-Z ]*PRIVATE KEY",  # RFC 7468 (PEM)
}
_CREDENTIAL = {kind: re.compile(rx) for kind, rx in CREDENTIAL_FORMATS.items()}
# The fix every refusal names: a secret goes by name (the cluster profile's list), its value stays in the shell.
FIX = "put its name in secrets = [...] and export it in your shell"


def is_secret(name: str) -> bool:
    """A name whose value must never be written anywhere (profiles refuse it in `env`, the plugin refuses it)."""
    return bool(_SECRET.search(name))


def credential_kind(value) -> str | None:
    """What credential `value` looks like ("a Hugging Face token"), or None."""
    return next((kind for kind, rx in _CREDENTIAL.items() if rx.search(str(value))), None)


def secret_problem(name: str, value) -> str | None:
    """Why `name=value` must not be written into a plan, a ledger or a job script, or None."""
    if is_secret(name):
        return f"{name} looks like a secret by its name"
    if kind := credential_kind(value):
        return f"the value of {name} looks like {kind}"
    return None
