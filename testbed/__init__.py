"""What tests, benchmarks and the demo drive servers with; never imported by the serving core.

- `texts`: Paul Graham essays from PyPI for long prompts;
- `retrieval`: passkey and needle-in-essays prompts and their scoring;
- `continuations`: essay passages and teacher-forced scores for the language-model suite;
- `teacher_forcing`: the custom logit processor that forces a continuation through a server
  (installed with the project so that a server can unpickle it);
- `dummy_models`: dummy-weight model folders (a config.json and a placeholder tokenizer);
- `server`: start an SGLang server as a subprocess, wait until it serves, stop its whole tree.
"""
