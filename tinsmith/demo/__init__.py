"""``tinsmith demo``: a small model made offline, then trained with RL through the real SDK.

``task`` defines the synthetic task (multi-digit addition) and its character tokenizer,
``pretrain`` makes the partially competent starting model, ``run`` drives the server.
"""
