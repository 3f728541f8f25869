"""Integrations of gradshare's DDP communication hook with training frameworks (Accelerate, Transformers)."""
