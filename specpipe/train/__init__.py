"""Train an EAGLE head for any target, offline: `python -m specpipe.train model=hf model.path=DIR out=HEAD_DIR`.

corpus.py / data.py: the text and the target's own continuations; features.py: the target's forward over them;
heads.py: new EAGLE-3 / EAGLE-1 heads (specpipe's own modules) and their folders; ttt.py: the multi-step forward
and losses; loop.py: optimisation, checkpoints, resume; evaluate.py: held-out agreement and acceptance; app.py:
the run, phase by phase; __main__.py: the Hydra app.
"""
