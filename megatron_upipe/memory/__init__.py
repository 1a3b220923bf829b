"""Peak-memory tracking (tracker) and the closed-form memory model of the attention ops (attention_model)."""
