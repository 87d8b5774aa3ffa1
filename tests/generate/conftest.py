import pytest
import torch

from tidal.models import Transformer, get_flavor


@pytest.fixture(autouse=True)
def one_thread():
    """Generation tests run many tiny ops; on a shared 2-core machine each OpenMP barrier
    can wait milliseconds for a descheduled thread. Tests that check thread counts set
    their own."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def fresh_dynamo():
    """Each test compiles from scratch: graphs of earlier tests' shapes and dtypes would count
    against dynamo's recompile limit per function, past which it runs eagerly. The CUDA test
    modules use it for every test (`pytest.mark.usefixtures("fresh_dynamo")`)."""
    import torch._dynamo

    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def tiny_model(flavor: str = "tiny", seed: int = 0, **kw) -> Transformer:
    """The 4-layer parity flavor (vocab 512), seed-initialized on CPU."""
    with torch.device("meta"):
        model = Transformer(get_flavor(flavor, **({"max_seq_len": 128} | kw)))
    model.to_empty(device="cpu")
    model.init_weights(seed=seed)
    return model


def qwen_tiny(seed: int = 0) -> Transformer:
    """A small Qwen 3 block (QK-norm, tied embeddings, head dim != dim / heads)."""
    return tiny_model(
        "debug_qwen3",
        seed,
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=24,
        ffn_dim=128,
        vocab_size=384,
    )


def moe_tiny(seed: int = 0) -> Transformer:
    """debug_moe shrunk: 2 layers of dim 64, 8 experts, 2 per token."""
    return tiny_model(
        "debug_moe",
        seed,
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        vocab_size=256,
    )


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory, text_corpus):
    """A 384-token byte-level BPE trained on the test corpus (fits the tiny models)."""
    from tidal.train.data import DataConfig, build_tokenizer

    cfg = DataConfig(
        dataset="jsonl",
        path=str(text_corpus),
        tokenizer="bpe",
        vocab_size=384,
        cache_dir=str(tmp_path_factory.mktemp("tok")),
    )
    return build_tokenizer(cfg, log=lambda line: None)
