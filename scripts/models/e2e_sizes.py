"""The sizes the end-to-end model zoo's framework modules share, in a module of their own:
e2e_models.py imports e2e_models_torch.py and e2e_models_tf.py, so they cannot import it back.
"""

# The benchmark GPT (e2e_models.py's ``gpt``): 6 blocks, 512 wide, 8 heads, a 16384-token
# vocabulary and a context of 128.
GPT = {"layers": 6, "width": 512, "heads": 8, "vocab": 16384, "context": 128}
