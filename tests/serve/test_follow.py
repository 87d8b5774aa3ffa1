"""`tidal serve --store`: the server follows the policy an RL run publishes to a tidal store,
and stamps each token with the version that produced it."""

from __future__ import annotations

import torch
from fastapi.testclient import TestClient

import tidal.store
from tests.serve.conftest import MODEL, make_served
from tidal.generate import logprobs
from tidal.models import Transformer, get_flavor
from tidal.serve.app import create_app
from tidal.serve.follow import StoreFollower


def _seeded(seed: int, max_seq_len: int) -> Transformer:
    with torch.device("meta"):
        model = Transformer(get_flavor("tiny", max_seq_len=max_seq_len))
    model.to_empty(device="cpu")
    model.init_weights(seed=seed)
    return model


def test_follows_new_versions_and_stamps_tokens(chat_tokenizer):
    store = tidal.store.connect(keep=2)
    try:
        policy = [_seeded(seed, 256) for seed in (1, 2)]
        store.put_state_dict(policy[0].state_dict(), "policy", version=0)
        model = _seeded(0, 256)  # other weights until the first load
        served = make_served(model, chat_tokenizer)
        gen = served.engine.generator
        follower = StoreFollower(gen, store, "policy", every=0.0)
        assert follower.load_first() == 0 and gen.version == 0
        gen.swap_hook = follower
        body = {"model": MODEL, "prompt": [0, 40, 41], "max_tokens": 5, "seed": 4}
        body |= {"return_token_ids": True}
        with TestClient(create_app(served)) as client:
            first = client.post("/v1/completions", json=body).json()["choices"][0]
            assert first["policy_versions"] == [0] * len(first["token_ids"])
            store.put_state_dict(policy[1].state_dict(), "policy", version=1)
            second = client.post("/v1/completions", json=body).json()["choices"][0]
        assert second["policy_versions"] == [1] * len(second["token_ids"])
        # Each response's log-probs are its version's: the trainer's scoring of those weights.
        for choice, weights in ((first, policy[0]), (second, policy[1])):
            ids = [0, 40, 41] + choice["token_ids"]
            ref = logprobs(weights, torch.tensor([ids]))[0, 2:]
            torch.testing.assert_close(
                torch.tensor(choice["token_logprobs"]), ref, atol=1e-4, rtol=1e-4
            )
    finally:
        store.close()


def test_a_failing_store_keeps_the_weights_held(tiny_model, chat_tokenizer, capsys):
    class Gone:
        def exists(self, key):
            raise ConnectionError("store unreachable")

    served = make_served(tiny_model, chat_tokenizer)
    follower = StoreFollower(served.engine.generator, Gone(), "policy", every=0.0)
    assert follower() is None and follower.errors == 1
    assert "following 'policy' failed: store unreachable" in capsys.readouterr().err
