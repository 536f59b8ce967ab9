"""Small timm models of every family specvit reads, shared by the tests that take a converted timm model
through the rest of the pipeline (FSDP2 training in tests/test_distributed.py, ONNX in tests/test_export.py).

Each is ``timm.create_model(name, **kwargs)``: one channel of 16 x 16 pixels and four classes, the batches
tests/dist_worker.py trains on, and no stochastic depth, so that two ranks draw nothing one process does not.
"""

from __future__ import annotations

from typing import Any

CONVERTED: dict[str, tuple[str, dict[str, Any]]] = {
    "vit_registers": (
        "vit_tiny_patch16_224",
        {"img_size": 16, "patch_size": 4, "in_chans": 1, "num_classes": 4, "embed_dim": 32, "depth": 2}
        | {"num_heads": 2, "reg_tokens": 2, "init_values": 1e-3},
    ),
    "swin": (
        "swin_tiny_patch4_window7_224",
        {"img_size": 16, "patch_size": 2, "in_chans": 1, "num_classes": 4, "embed_dim": 16}
        | {"depths": (2, 1), "num_heads": (1, 2), "window_size": 4, "drop_path_rate": 0.0},
    ),
    "sam": (
        "samvit_base_patch16",
        {"img_size": 16, "patch_size": 4, "in_chans": 1, "num_classes": 4, "global_pool": "avg"}
        | {"embed_dim": 32, "depth": 2, "num_heads": 2, "window_size": 3, "global_attn_indexes": (1,)}
        | {"neck_chans": 16, "drop_path_rate": 0.0},
    ),
    "cait": (
        "cait_xxs24_224",
        {"img_size": 16, "patch_size": 4, "in_chans": 1, "num_classes": 4, "embed_dim": 32, "depth": 2}
        | {"num_heads": 2, "depth_token_only": 1},
    ),
    "beit": (  # per-layer relative bias, q/v bias, layer scale, mean pool + fc_norm
        "beit_base_patch16_224",
        {"img_size": 16, "patch_size": 4, "in_chans": 1, "num_classes": 4, "embed_dim": 32, "depth": 2}
        | {"num_heads": 2},
    ),
    "deit_distilled": (  # class and distillation tokens, two classifiers averaged
        "deit_tiny_distilled_patch16_224",
        {"img_size": 16, "patch_size": 4, "in_chans": 1, "num_classes": 4, "embed_dim": 32, "depth": 2}
        | {"num_heads": 2},
    ),
    "eva": (  # 2D RoPE in EVA's layout, SwiGLU with its inner norm, layer scale
        "eva02_tiny_patch14_224",
        {"img_size": 16, "patch_size": 4, "in_chans": 1, "num_classes": 4, "embed_dim": 32, "depth": 2}
        | {"num_heads": 2, "scale_mlp": True, "init_values": 1e-3},
    ),
    "swinv2": (
        "swinv2_tiny_window8_256",
        {"img_size": 16, "patch_size": 2, "in_chans": 1, "num_classes": 4, "embed_dim": 16}
        | {"depths": (2, 1), "num_heads": (1, 2), "window_size": 4, "drop_path_rate": 0.0},
    ),
}


def converted_checkpoint(name: str, directory: Any) -> None:
    """Build the timm model ``name`` of :data:`CONVERTED` (seeded, perturbed), read it with
    ``specvit.from_timm``, convert its weights and ``save_pretrained`` the result into ``directory``."""
    from reference import converted, timm_model

    import specvit

    timm_name, kwargs = CONVERTED[name]
    ref = timm_model(timm_name, seed=3, **kwargs)
    converted(ref, specvit.from_timm(ref), "timm").save_pretrained(directory, overwrite=True)
