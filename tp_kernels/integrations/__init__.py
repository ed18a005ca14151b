"""Integrations with the frameworks people train with: Hugging Face transformers (:mod:`.hf`) and
torchtitan (:mod:`.torchtitan`). Each is imported on its own and needs its framework installed."""
