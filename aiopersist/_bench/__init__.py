"""The benchmarks and the demos behind ``aiopersist bench`` and ``aiopersist demo*``.

Imported only by the CLI (`aiopersist._cli`), never by the library: they use the public
API where it has what they need, and a few internals it does not expose (the knobs, the
backend's resolved name, aligned buffers for the raw-device baseline). One module each:
`raw` (``bench raw``: the engine against fio), `ckpt` (``bench save`` / ``bench load``
against torch.save, safetensors and DCP), `spread` (``--ranks --dirs``), `train`
(``bench train``), `gpu` (``bench gpu``) and `demo_trainer` (``demo-trainer``).
"""
