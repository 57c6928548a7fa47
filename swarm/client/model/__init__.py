"""The client model: the Hugging Face-style causal LM and its model session, the LM head, adapters, prompt tuning
and classification.
"""
