//! Per-sequence key/value cache. Truncating it to an earlier length is O(1): rows past the new length are simply
//! overwritten by the next forward pass, which is how rejected draft tokens are rolled back without recomputation.

use crate::model::config::Config;

struct LayerCache {
    /// Layout `[kv_head][capacity][head_dim]`, so one head's keys are contiguous for the attention loop.
    keys: Vec<f32>,
    values: Vec<f32>,
}

pub struct KvCache {
    layers: Vec<LayerCache>,
    len: usize,
    capacity: usize,
    num_kv_heads: usize,
    head_dim: usize,
    max_len: usize,
}

impl KvCache {
    pub fn new(config: &Config) -> Self {
        KvCache {
            layers: (0..config.num_layers)
                .map(|_| LayerCache {
                    keys: Vec::new(),
                    values: Vec::new(),
                })
                .collect(),
            len: 0,
            capacity: 0,
            num_kv_heads: config.num_kv_heads,
            head_dim: config.head_dim,
            max_len: config.context_length,
        }
    }

    /// Number of positions held.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The model's context length: the most positions this cache will hold.
    pub fn max_len(&self) -> usize {
        self.max_len
    }

    /// Forgets every position at or after `len`.
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    pub fn clear(&mut self) {
        self.len = 0;
    }

    /// Makes room for `needed` positions, growing geometrically and keeping the head-major layout.
    pub(crate) fn reserve(&mut self, needed: usize) {
        if needed <= self.capacity {
            return;
        }
        let new_cap = needed
            .max(self.capacity * 2)
            .max(64)
            .min(self.max_len.max(needed));
        let (heads, hd, old_cap, len) = (self.num_kv_heads, self.head_dim, self.capacity, self.len);
        for layer in &mut self.layers {
            for buf in [&mut layer.keys, &mut layer.values] {
                let mut grown = vec![0f32; heads * new_cap * hd];
                for h in 0..heads {
                    let src = &buf[h * old_cap * hd..h * old_cap * hd + len * hd];
                    grown[h * new_cap * hd..h * new_cap * hd + len * hd].copy_from_slice(src);
                }
                *buf = grown;
            }
        }
        self.capacity = new_cap;
    }

    /// Stores the keys and values of position `pos` (each `num_kv_heads * head_dim` long, head-major).
    pub(crate) fn write(&mut self, layer: usize, pos: usize, key: &[f32], value: &[f32]) {
        let (hd, cap) = (self.head_dim, self.capacity);
        let lc = &mut self.layers[layer];
        for h in 0..self.num_kv_heads {
            let dst = h * cap * hd + pos * hd;
            lc.keys[dst..dst + hd].copy_from_slice(&key[h * hd..(h + 1) * hd]);
            lc.values[dst..dst + hd].copy_from_slice(&value[h * hd..(h + 1) * hd]);
        }
    }

    /// Keys and values of one KV head for positions `0..n`.
    pub(crate) fn head(&self, layer: usize, kv_head: usize, n: usize) -> (&[f32], &[f32]) {
        let (hd, cap) = (self.head_dim, self.capacity);
        let start = kv_head * cap * hd;
        let lc = &self.layers[layer];
        (
            &lc.keys[start..start + n * hd],
            &lc.values[start..start + n * hd],
        )
    }

    pub(crate) fn set_len(&mut self, len: usize) {
        debug_assert!(len <= self.capacity);
        self.len = len;
    }

    /// Bytes held by the cache buffers.
    pub fn allocated_bytes(&self) -> usize {
        self.layers.len() * 2 * self.num_kv_heads * self.capacity * self.head_dim * 4
    }
}
