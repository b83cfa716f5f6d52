"""DeepSpeed's unit tests (vendored beside this file) that fail against infinity, each with why.
A key is `file::test` (every parametrisation) or `file::test[params]` (that one); conftest.py
marks them as strict xfails, and tests/test_vendored_suites.py checks that nothing else fails.
Files that cannot be imported at all are in COLLECTION_ERRORS. The README's "Moving from
DeepSpeed" section lists these groups."""

_WRAPPED = ("asserts which optimizer class DeepSpeed builds inside its ZeRO optimizer (FusedAdam, DeepSpeedCPUAdam, "
            "torch's AdamW) and reads it as engine.optimizer.optimizer; infinity's engine runs its own update rule over "
            "the shards and wraps no torch optimizer when the config's optimizer section builds it "
            "(engine.optimizer.optimizer is the client optimizer when one is given)")
_RETURNED = ("asserts that initialize returns the client optimizer itself (or a FusedAdam) as its optimizer; infinity "
             "returns the engine's optimizer, a ZeroOptimizer over the client's param groups, at every stage")
_MORE_DTYPES = ("asserts that ZeRO stage 0 refuses this model dtype / grad_accum_dtype pair with NotImplementedError; "
                "infinity supports it (fp32 masters, gradients accumulated in fp32)")
_ALLREDUCE = "gradient_allreduce_op (DeepSpeed's sum/mean choice for gradient reduction) is not implemented by infinity"
_PYDANTIC = ("reads DeepSpeed's pydantic config model (short field names, deprecated aliases, None sections); "
             "infinity's DeepSpeedZeroConfig is its own parser's ZeroConfig, whose fields are the JSON keys and which "
             "refuses deprecated keys by name")
_OFFLOAD_BELOW_3 = ("gives offload_param at ZeRO stage 0, which DeepSpeed ignores; infinity refuses a setting that would "
                    "have no effect, naming it")
_ASSERTION = ("expects DeepSpeed's bare AssertionError; infinity raises a ValueError naming the argument and what was "
              "expected")

EXPECTED_FAILURES: dict[str, str] = {
    "unit/ops/adam/test_adamw.py::TestAdamConfigs::test": _WRAPPED,
    "unit/runtime/test_ds_initialize.py::TestClientOptimizer::test": _RETURNED,
    "unit/runtime/test_ds_initialize.py::TestConfigOptimizer::test": _RETURNED,
    "unit/runtime/test_ds_initialize.py::TestOptimizerImplementation::test[fp16-fp32-None]": _MORE_DTYPES,
    "unit/runtime/test_ds_initialize.py::TestOptimizerImplementation::test[bf16-fp16-None]": _MORE_DTYPES,
    "unit/runtime/test_ds_initialize.py::TestOptimizerImplementation::test[bf16-fp32-None]": _MORE_DTYPES,
    "unit/runtime/test_ds_initialize.py::TestOptimizerImplementation::test[fp32-fp16-None]": _MORE_DTYPES,
    "unit/runtime/test_ds_initialize.py::TestNoOptim::test[0]": _OFFLOAD_BELOW_3,
    "unit/runtime/test_ds_initialize.py::TestClientLrScheduler::test[None-_LRScheduler]": _ASSERTION,
    "unit/runtime/test_ds_initialize.py::TestClientLrScheduler::test[Callable-_LRScheduler]": _ASSERTION,
    "unit/runtime/test_ds_config_dict.py::TestNoModel::test": _ASSERTION,
    "unit/runtime/test_ds_config_dict.py::test_gradient_allreduce_op": _ALLREDUCE,
    "unit/runtime/test_ds_config_dict.py::test_gradient_allreduce_op_default": _ALLREDUCE,
    "unit/runtime/test_ds_config_dict.py::test_invalid_gradient_allreduce_op": _ALLREDUCE,
    "unit/runtime/test_ds_config_dict.py::test_sum_gradient_allreduce_rejects_zero3": _ALLREDUCE,
    "unit/runtime/test_ds_config_dict.py::test_sum_gradient_allreduce_rejects_zenflow": _ALLREDUCE,
    "unit/runtime/test_ds_config_dict.py::test_sum_gradient_allreduce_rejects_deepcompile": _ALLREDUCE,
    "unit/runtime/test_ds_config_dict.py::test_gather_16bit_params_on_model_save": _PYDANTIC,
    "unit/runtime/test_ds_config_dict.py::test_quantized_eigenvalue_config_parses": (
        "reads a config file from DeepSpeed's repository (tests/model/BingBertSquad), not vendored, for "
        "quantize_training / eigenvalue, which infinity does not implement"),
    "unit/runtime/test_ds_config_dict.py::test_compression_training_without_legacy_quantize_training_uses_defaults": (
        "compression_training is not implemented by infinity (a key it refuses by name)"),
    "unit/runtime/zero/test_zero_config.py::test_zero_config_deprecatedfields": _PYDANTIC,
    "unit/runtime/zero/test_zero_config.py::test_zero_config_aliasfields": _PYDANTIC,
    "unit/runtime/zero/test_zero_config.py::test_zero_config_pipeline_loading_checkpoint": _PYDANTIC,
    "unit/runtime/zero/test_zero_config.py::test_zero_config_offload_configs": _PYDANTIC,
    "unit/v1/half_precision/test_gradient_clipping_default.py::TestGradientClippingConfig::"
    "test_engine_getter_returns_config_value": (
        "calls DeepSpeedEngine.gradient_clipping on a stand-in holding DeepSpeed's private `_config`; infinity's "
        "getter reads its own config (the end-to-end tests of the same file pass)"),
}

COLLECTION_ERRORS: dict[str, str] = {
    "unit/runtime/test_ds_config_model.py": (
        "tests DeepSpeed's pydantic base class deepspeed.runtime.config_utils.DeepSpeedConfigModel, which infinity "
        "does not have"),
    "unit/runtime/zero/test_zero_grad_clip.py": (
        "imports safe_get_local_grad / safe_set_local_grad (one rank's partition of a gradient, not provided: "
        "infinity has the safe_get_full_* helpers) and asserts the private DeepSpeedZeroOptimizer_Stage3._get_norm_groups"),
}
