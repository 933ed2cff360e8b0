"""Example training code: the model behind the bundled sample run (sample_ckpts/)."""
