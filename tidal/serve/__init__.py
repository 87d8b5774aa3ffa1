"""An OpenAI-compatible server on the Generator: `tidal serve`.

- engine.py: `Engine`, one background thread owning the Generator; requests of many clients
  are fed to one `Generator.stream` and decoded together (continuous batching).
- api.py: `Served`, the endpoints without the web stack (request body -> prompts and
  SamplingParams -> response body, with the token-id extension).
- schema.py: which request fields are read, ignored or refused; `ApiError`.
- chat.py: chat messages and tools (the RL environments' tool format) to prompt ids, tool calls
  parsed back.
- follow.py: `StoreFollower`, the newest policy of an RL run's store, swapped in as published.
- app.py: the FastAPI routes; cli.py: the command line.

Only app.py and cli.py's `main` import FastAPI and uvicorn (the `serve` extra); outside
tidal/serve only the command line and tidal/rl/envs/verifiers.py (which serves the policy to
verifiers, `app.serve_in_thread`) import this package, lazily.
"""
