"""The functional decode loop: decoder, state, set-up, in-step admission, sampling, sharding.

decoder   `Decoder`: prefill, decode_step / window_step, generate, score
state     `DecodeState` and how a step updates it; `summarize`
setup     what the decoder settles on the host before anything is traced
follow    the policy's in-step rule (lrfu, the field's rules, +follow) inside the layers, its
          moves applied after them
window    the window boundary: the plan between steps, its migration, the next W
prompt    the prompt's last queries at prefill, and the prior a policy (`lrfu`) starts from
sampling  token samplers (`Greedy`, `Sampling`)
sharded   `ShardedDecoder`: the cache and loop on a ("data", "model") mesh
per_device  `PerDevice`: a device's own link profile inside a sharded decode
"""
