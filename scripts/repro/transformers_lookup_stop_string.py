"""Standalone reproduction: transformers' prompt-lookup decoding goes on past a stop string completed inside an
accepted block, and assisted decoding with a draft model raises on any stop string.

Needs only torch, tokenizers and transformers (no spectr-audit, nothing downloaded).  Measured with transformers
5.19.0; the lines cited are the same code in 5.25.0 (the latest on PyPI on 2026-12-04), line numbers in brackets.
A default install reaches both with an ordinary request: ``model.generate(ids, stop_strings=[...],
tokenizer=tok, prompt_lookup_num_tokens=3)`` (or ``assistant_model=draft``), greedy.

Configuration: a character-level tokenizer (one token per character) and a random 2-layer Llama whose attention
and MLP outputs are zeroed, so that its greedy next token depends on the current token only: its greedy
continuations cycle, and a prompt holding a cycle twice makes prompt lookup accept whole blocks.  For each cycle
and each position ``m``, the two-character text of the plain greedy continuation at ``m - 1, m`` (first completed
at ``m``, not across the prompt's end) is the stop string; plain ``generate`` stops at ``m``, as it must.

The cause, in transformers' own source (``generation/utils.py``, ``_assisted_decoding``, which prompt lookup
and assisted decoding share): the accepted block is appended whole (``input_ids = torch.cat((input_ids,
valid_tokens), dim=-1)``, line 4134 [4178]) and cropped only at an end-of-sequence token (lines 4120-4130); the
stopping criteria run once per block, after it (line 4199 [4251]), and ``StopStringCriteria`` matches only a stop
string that overlaps the sequence's last token (``generation/stopping_criteria.py:135-146`` [129-140]).  A stop
string completed before a block's last token is never seen; the row goes on.  With a draft model,
``AssistedCandidateGenerator`` copies the target's generation config, stop strings included
(``generation/candidate_generator.py:171`` [167]), into the draft's own ``generate`` call without the tokenizer
(line 323 [328]), which raises ``ValueError`` (``generation/utils.py:1654-1659`` [1686-1691]).

    python transformers_lookup_stop_string.py

Exit status 1: reproduced (each differing request is printed); 0: not reproduced.
"""

import string
import sys

import torch
from tokenizers import Tokenizer, decoders, pre_tokenizers
from tokenizers.models import WordLevel
import transformers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

CHARS = string.ascii_lowercase + string.digits + " .,"


def tokenizer():
    vocab = {c: i for i, c in enumerate(CHARS)}
    vocab["<unk>"] = len(vocab)
    backend = Tokenizer(WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")  # one token per character
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<unk>")


def model(vocab_size, seed):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256,
                         bos_token_id=None, eos_token_id=vocab_size - 1, pad_token_id=vocab_size - 1)
    m = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.zero_()  # no attention, no MLP: the next token depends on the current one only
    return m


def cycle(m, start, vocab_size):
    """The greedy chain of the model from ``start`` until it repeats: its cycle."""
    seen, token = [], start
    while token not in seen:
        seen.append(token)
        token = int(m(torch.tensor([[token]])).logits[0, -1].argmax())
    return seen[seen.index(token):]


if __name__ == "__main__":
    tok = tokenizer()
    target = model(len(tok), 0)
    differ = cases = 0
    loops = {tuple(cycle(target, t, len(tok) - 1)) for t in range(len(tok) - 1)}
    prompts = [list(loop) * 2 for loop in sorted(loops) if len(loop) >= 3]
    for prompt in prompts:
        text = tok.decode(prompt)
        ids = torch.tensor([prompt])
        kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=24, pad_token_id=len(tok) - 1)
        free = target.generate(ids, **kw)[0, ids.shape[1]:].tolist()
        for m in range(2, 20):
            stop = tok.decode(free[m - 1:m + 1])  # two tokens' text, first completed at position m
            if stop in tok.decode(prompt[-1:] + free[:m]):  # completed earlier (or across the prompt's end)
                continue
            cases += 1
            plain = target.generate(ids, stop_strings=[stop], tokenizer=tok, **kw)[0, ids.shape[1]:].tolist()
            lookup = target.generate(ids, stop_strings=[stop], tokenizer=tok, prompt_lookup_num_tokens=3,
                                     **kw)[0, ids.shape[1]:].tolist()
            if plain != lookup:
                differ += 1
                print(f"prompt {text!r} stop {stop!r}: plain {tok.decode(plain)!r}, prompt lookup {tok.decode(lookup)!r}")
    # the same request with a draft model (here the target itself): generate raises before any token
    try:
        ids = torch.tensor([prompts[0]])
        target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=8,
                        pad_token_id=len(tok) - 1, stop_strings=[tok.decode(prompts[0][:2])], tokenizer=tok,
                        assistant_model=target)
        assisted = "served"
    except ValueError as error:
        assisted = f"raised ValueError: {str(error)[:120]}"
    print(f"transformers {transformers.__version__}: {differ} of {cases} requests end differently with prompt "
          f"lookup; assisted decoding with stop strings {assisted}")
    sys.exit(1 if differ or assisted != "served" else 0)
