"""The one credential rule (src/overlapkit/secrets.py): each documented shape is caught under any name, and the
values a plan legitimately carries are not."""

from __future__ import annotations

import pytest

from overlapkit.secrets import CREDENTIAL_FORMATS, credential_kind, is_secret, secret_problem

# One made-up example per shape (none is a real credential), under the kind it must be reported as.
EXAMPLES = {
    "a Hugging Face token": "hf_AbCdEfGhIjKlMnOpQrStUvWxYz0123456789",
    "a W&B API key": "0123456789abcdef0123456789abcdef01234567",
    "a GitHub token": "github_pat_11ABCDEFG0123456789_abcdefghijklmnopqrstuvwxyzABCDEFGH",
    "a GitLab token": "glpat-AbCdEfGhIjKlMnOpQrSt",
    "an AWS access key": "AKIAABCDEFGHIJKLMNOP",
    "a Google Cloud API key": "AIzaSyA-abcdefghijklmnopqrstuvwxyz01234",
    "a Google OAuth access token": "ya29.a0AfH6SMBabcdefghijklmnopqrstuvwxyz",
    "an NVIDIA NGC key": "nvapi-AbCdEfGhIjKlMnOpQrStUvWx",
    "an Anthropic API key": "sk-ant-api03-AbCdEfGhIjKlMnOpQrStUvWx",
    "an OpenAI-style key": "sk-proj-AbCdEfGhIjKlMnOpQrStUvWx",
    "a Slack token": "xoxb-1234567890-0987654321-AbCdEfGhIjKl",
    "a JSON Web Token": "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U",
    "a PyPI token": "pypi-AgEIcHlwaS5vcmcCJGFiY2RlZmdo",
    "an Azure key": "DefaultEndpointsProtocol=https;AccountName=a;AccountKey=QUJDREVGR0hJSktMTU5PUFFSU1RVVg==",
    "a password in a URL": "https://alice:s3cr3t@registry.example.com/v2/",
    "a private key": "-----BEGIN OPENSSH PRIVATE KEY-----",
}


def test_every_shape_has_an_example():
    assert set(EXAMPLES) == set(CREDENTIAL_FORMATS)


@pytest.mark.parametrize(("kind", "value"), EXAMPLES.items(), ids=list(EXAMPLES))
def test_each_shape_is_caught_under_an_innocuous_name_and_inside_a_longer_value(kind, value):
    assert credential_kind(value) == kind
    assert credential_kind(f"--export=ALL,NCCL_HINT={value},X=1") == kind
    assert secret_problem("NCCL_COLLNET_HINT", value) == f"the value of NCCL_COLLNET_HINT looks like {kind}"


@pytest.mark.parametrize(
    "value",
    [
        "sha256:" + "a" * 64,  # a content digest: 64 hex characters, not a W&B key's 40
        "123e4567-e89b-12d3-a456-426614174000",  # a UUID
        "expandable_segments:True",
        "/lustre/fsw/portfolios/llm/users/alice/data/train_text_document",
        "nvcr.io#nvidia/nemo:25.09",
        "docker://nvcr.io/nvidia/nemo@sha256:" + "b" * 64,
        "mlx5_0:1,mlx5_1:1",
        "sk-short",
        "eyJ",
        "xoxb",
        "ssh://git@github.com/org/repo",
        "https://huggingface.co/meta-llama/Llama-3.1-8B",
    ],
)
def test_what_a_plan_carries_is_not_a_credential(value):
    assert credential_kind(value) is None


@pytest.mark.parametrize("name", ["WANDB_API_KEY", "HF_TOKEN", "MY_TOKEN_FILE", "DB_PASSWD", "GCP_CREDENTIALS"])
def test_a_secret_by_its_name(name):
    assert is_secret(name) and secret_problem(name, "x") == f"{name} looks like a secret by its name"


def test_a_count_of_tokens_is_not_a_secret():
    assert not is_secret("NUM_OF_TOKENS_PER_CHUNK_COMBINE_API") and not is_secret("NCCL_IB_HCA")
