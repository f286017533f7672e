"""The embedded model's worker process: llama-cpp-python behind a pipe, and nothing else.

``llms.LocalRunner`` runs this file as a script (``python -P llms/worker.py FD FD CONFIG``). It
imports only the standard library and, once it runs, llama-cpp-python, so a worker starts
without loading brag, numpy, bm25s or the HTTP stack (``bench/worker_startup.py`` measures it).
A native crash in it costs the request in flight, not the server.
"""

from __future__ import annotations

import json
import sys
from multiprocessing.connection import Connection
from typing import Any


def plain_prompt(messages: list[dict[str, str]]) -> str:
    """Chat messages as one few-shot completion prompt.

    The instructions, then each exchange as a block with the reply right under what was asked;
    the prompt ends on a new line after the last question, so the model writes the reply in the
    pattern of the examples ("Answer: ...").
    """
    blocks: list[str] = []
    for message in messages:
        content = message.get("content", "").strip()
        if message.get("role") == "assistant" and blocks:
            blocks[-1] += "\n" + content
        elif content:
            blocks.append(content)
    return "\n\n".join(blocks) + "\n"


def main(argv: list[str]) -> None:
    """The worker process: load the model, then answer requests until the parent goes away."""
    requests = Connection(int(argv[0]), writable=False)
    replies = Connection(int(argv[1]), readable=False)
    config = json.loads(argv[2])
    try:
        model = load_llama(config)
    except Exception as err:  # a corrupt or foreign file
        replies.send({"error": f"{type(err).__name__}: {err}"})
        return
    replies.send({"ready": True})
    while True:
        try:
            request = requests.recv()
        except (EOFError, OSError):
            return  # the parent closed the pipe or died
        try:
            replies.send({"generating": True})  # the parent logs it: the request is in the model
            replies.send(generate(model, request))
        except Exception as err:  # e.g. a prompt longer than the context
            replies.send({"error": str(err)})


def load_llama(config: dict[str, Any]) -> Any:
    """The model in ``config["path"]``, loaded by llama-cpp-python (imported only here)."""
    import llama_cpp
    import llama_cpp.llama_cpp as native

    # llama.cpp repacks weights into "extra buffer types", and on hosts that advertise Intel AMX
    # but fault on it, that is where it crashes (SIGSEGV in ggml_backend_amx_mul_mat), whatever
    # the build. Repacking bought nothing measurable here (bench/results/llm_latency.md), so the
    # runner always turns it off; only that benchmark turns it on. Llama() takes no argument
    # for it, so the defaults are amended in this process.
    defaults = native.llama_model_default_params
    extra_buffers = bool(config.get("extra_buffers", False))

    def model_params() -> Any:
        params = defaults()
        if hasattr(params, "use_extra_bufts"):
            params.use_extra_bufts = extra_buffers
        return params

    native.llama_model_default_params = model_params
    threads = config["n_threads"]
    return llama_cpp.Llama(
        model_path=config["path"],
        n_ctx=config["n_ctx"],
        n_threads=threads,
        n_threads_batch=threads,
        flash_attn=True,  # about 25 % faster on 2,000-token reads here
        verbose=False,
    )


class TokenLogprobs:
    """A logits processor that records each generated token's log-probability, changing nothing.

    llama-cpp-python gives ``logprobs`` only to a model built with ``logits_all=True``, which
    computes logits for every prompt token too (a five-passage read took half as long again).
    A processor sees the logits of each step anyway; the token chosen at one step is the last
    input id at the next, so each step records the one before it. The last token (a stop
    string or the end of text, past any answer) is not recorded.

    With ``forced`` token ids it scores a given text instead: each step keeps only the next
    forced token, and records its log-probability under the model's own logits.
    """

    def __init__(self, model: Any, forced: list[int] | None = None) -> None:
        import codecs

        import numpy

        self.model, self.numpy, self.forced = model, numpy, forced
        self.pieces: list[list[Any]] = []
        self._previous: tuple[Any, float] | None = None  # the last step's logits and their log-sum-exp
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def _record(self, token: int, scores: Any, log_total: float) -> None:
        piece = self._decoder.decode(self.model.detokenize([token]))
        self.pieces.append([piece, round(float(scores[token]) - log_total, 5)])

    def __call__(self, input_ids: Any, logits: Any) -> Any:
        """Record a step; return the logits unchanged (or, scoring, only the forced token's)."""
        top = float(logits.max())
        log_total = top + float(self.numpy.log(self.numpy.exp(logits - top).sum()))
        if self.forced is not None:
            step = len(self.pieces)
            if step < len(self.forced):
                token = self.forced[step]
                self._record(token, logits, log_total)
                kept = logits[token]
                logits[:] = -self.numpy.inf
                logits[token] = kept
            return logits
        if self._previous is not None and len(input_ids):
            self._record(int(input_ids[-1]), *self._previous)
        self._previous = (logits.copy(), log_total)
        return logits


def generate(model: Any, request: dict[str, Any]) -> dict[str, Any]:
    """``n`` samples (seeds seed, seed + 1, ...) in the requested prompt format, with log-probs.

    With ``score`` (a list of texts) it generates nothing new: each text is forced token by
    token, and comes back with its log-probabilities.
    """
    texts, logprobs, prompt_tokens, completion_tokens = [], [], 0, 0
    seed, scoring = request["seed"], request.get("score")
    for i in range(len(scoring) if scoring is not None else request["n"]):
        forced = None
        kwargs = {
            "max_tokens": request["max_tokens"],
            "temperature": request["temperature"],
            "stop": request["stop"],
            "seed": None if seed is None else seed + i,
        }
        if scoring is not None:
            forced = model.tokenize(scoring[i].encode("utf-8"), add_bos=False, special=False)
            kwargs.update(max_tokens=max(1, len(forced)), temperature=0.0, stop=[])
        recorder = TokenLogprobs(model, forced)
        kwargs["logits_processor"] = [recorder]
        if request["format"] == "chat":
            out = model.create_chat_completion(messages=request["messages"], **kwargs)
            text = out["choices"][0]["message"]["content"] or ""
        else:
            out = model.create_completion(plain_prompt(request["messages"]), **kwargs)
            text = out["choices"][0]["text"]
        texts.append(text if scoring is None else scoring[i])
        logprobs.append(recorder.pieces[: len(forced)] if forced is not None else recorder.pieces)
        # The samples share one prompt, which the model's cache evaluates once: counted once, as
        # an API bills n samples of one prompt.
        prompt_tokens += out["usage"]["prompt_tokens"] if i == 0 or scoring is not None else 0
        completion_tokens += out["usage"]["completion_tokens"]
    return {
        "texts": texts,
        "logprobs": logprobs,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
    }


if __name__ == "__main__":
    main(sys.argv[1:])
