"""What the scripts at the top level (train.py, sample.py, bench.py, eval.py, compare.py, grow.py) share.

Each module takes its inputs as arguments and never imports a script; model.py stays a single file
beside the scripts, as in nanoGPT. Importing the package imports nothing heavy.
"""
