"""Model shapes the benchmarks build with random weights (no download)."""

# Qwen3-8B: 36 layers, hidden 4096, 32 query / 8 KV heads of 128, FFN 12288, vocab 151,936
QWEN3_8B = dict(
    vocab_size=151936,
    hidden_size=4096,
    intermediate_size=12288,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rope_theta=1e6,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)

# Qwen3-1.7B's and Qwen3-4B's published configs (the widths between pystd's 384 and 8B's 4,096:
# where fp8 matmuls start to pay, twenty-eighth session)
QWEN3_1_7B = dict(
    QWEN3_8B,
    hidden_size=2048,
    intermediate_size=6144,
    num_hidden_layers=28,
    num_attention_heads=16,
    tie_word_embeddings=True,
)
QWEN3_4B = dict(
    QWEN3_8B,
    hidden_size=2560,
    intermediate_size=9728,
    num_hidden_layers=36,
    num_attention_heads=32,
    tie_word_embeddings=True,
)


# pystd-28m (../shared/models/pystd-28m): the recipe's small real target, Qwen3 architecture
PYSTD_28M = dict(
    vocab_size=8192,
    hidden_size=384,
    intermediate_size=1536,
    num_hidden_layers=10,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=4096,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
