"""A StepPlan run on the device: the runner (launch, finish), its host staging and packing,
decode buckets recorded (CUDA graphs on a GPU), block tables, logits processing and sampling
outputs, the warm-up, speculation's draft model."""
