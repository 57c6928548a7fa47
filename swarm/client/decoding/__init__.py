"""The client's decoding: the decode loop and its policies, sampling, Hugging Face-style `generate` settings,
speculation and drafting, beams, grammars, and a session's rows.
"""
