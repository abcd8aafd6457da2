//! Per-sequence key/value cache on the CPU. Truncating it to an earlier length is O(1): rows past the new length
//! are simply overwritten by the next forward pass, which is how rejected draft tokens are rolled back without
//! recomputation.

use crate::error::Result;
use crate::model::config::Config;
use crate::model::forward::SequenceCache;

struct LayerCache {
    /// Layout `[kv_head][capacity][head_dim]`, so one head's keys are contiguous for the attention loop.
    keys: Vec<f32>,
    values: Vec<f32>,
}

pub struct KvCache {
    layers: Vec<LayerCache>,
    len: usize,
    /// Positions the buffers have room for (grown geometrically up to `max_len`).
    allocated: usize,
    num_kv_heads: usize,
    head_dim: usize,
    max_len: usize,
}

impl KvCache {
    /// An empty cache holding up to `max_len` positions (grown on demand).
    pub fn new(config: &Config, max_len: usize) -> Self {
        KvCache {
            layers: (0..config.num_layers)
                .map(|_| LayerCache {
                    keys: Vec::new(),
                    values: Vec::new(),
                })
                .collect(),
            len: 0,
            allocated: 0,
            num_kv_heads: config.num_kv_heads,
            head_dim: config.head_dim,
            max_len,
        }
    }

    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// Values per position of one layer's keys (KV heads x head dimension).
    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// Number of positions held.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The most positions this cache will hold.
    pub fn capacity(&self) -> usize {
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
        if needed <= self.allocated {
            return;
        }
        let new_cap = needed
            .max(self.allocated * 2)
            .max(64)
            .min(self.max_len.max(needed));
        let (heads, hd, old_cap, len) =
            (self.num_kv_heads, self.head_dim, self.allocated, self.len);
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
        self.allocated = new_cap;
    }

    /// Stores the keys and values of position `pos` (each `num_kv_heads * head_dim` long, head-major).
    pub(crate) fn write(&mut self, layer: usize, pos: usize, key: &[f32], value: &[f32]) {
        let (hd, cap) = (self.head_dim, self.allocated);
        let lc = &mut self.layers[layer];
        for h in 0..self.num_kv_heads {
            let dst = h * cap * hd + pos * hd;
            lc.keys[dst..dst + hd].copy_from_slice(&key[h * hd..(h + 1) * hd]);
            lc.values[dst..dst + hd].copy_from_slice(&value[h * hd..(h + 1) * hd]);
        }
    }

    /// Keys and values of one KV head for positions `0..n`.
    pub(crate) fn head(&self, layer: usize, kv_head: usize, n: usize) -> (&[f32], &[f32]) {
        let (hd, cap) = (self.head_dim, self.allocated);
        let start = kv_head * cap * hd;
        let lc = &self.layers[layer];
        (
            &lc.keys[start..start + n * hd],
            &lc.values[start..start + n * hd],
        )
    }

    pub(crate) fn set_len(&mut self, len: usize) {
        debug_assert!(len <= self.allocated);
        self.len = len;
    }

    /// Replaces its contents with the first `n` positions of `src` (same shape).
    pub fn copy_prefix(&mut self, src: &KvCache, n: usize) -> Result<()> {
        crate::model::forward::check_prefix_copy(src.len, n, self.max_len)?;
        if (src.layers.len(), src.num_kv_heads, src.head_dim)
            != (self.layers.len(), self.num_kv_heads, self.head_dim)
        {
            return Err(crate::error::Error::InvalidArgument(format!(
                "cannot copy positions between KV caches of different shapes ({} layers x {} heads x {} against \
                 {} x {} x {})",
                src.layers.len(),
                src.num_kv_heads,
                src.head_dim,
                self.layers.len(),
                self.num_kv_heads,
                self.head_dim
            )));
        }
        self.len = 0;
        self.reserve(n);
        let (hd, dst_cap, src_cap) = (self.head_dim, self.allocated, src.allocated);
        for (dst, from) in self.layers.iter_mut().zip(&src.layers) {
            for (d, s) in [(&mut dst.keys, &from.keys), (&mut dst.values, &from.values)] {
                for h in 0..self.num_kv_heads {
                    let (di, si) = (h * dst_cap * hd, h * src_cap * hd);
                    d[di..di + n * hd].copy_from_slice(&s[si..si + n * hd]);
                }
            }
        }
        self.len = n;
        Ok(())
    }

    /// Bytes held by the cache buffers.
    pub fn allocated_bytes(&self) -> usize {
        self.layers.len() * 2 * self.num_kv_heads * self.allocated * self.head_dim * 4
    }
}

impl SequenceCache for KvCache {
    fn len(&self) -> usize {
        self.len
    }

    fn capacity(&self) -> usize {
        self.max_len
    }

    fn truncate(&mut self, len: usize) {
        KvCache::truncate(self, len)
    }

    fn keep_new_rows(&mut self, base: usize, rows: &[usize]) -> Result<()> {
        crate::model::forward::check_keep_rows(self.len, base, rows)?;
        let (hd, cap) = (self.head_dim, self.allocated);
        for layer in &mut self.layers {
            for buf in [&mut layer.keys, &mut layer.values] {
                for h in 0..self.num_kv_heads {
                    for (j, &r) in rows.iter().enumerate() {
                        // Increasing rows move down or stay, so each source is read before it is overwritten.
                        let (from, to) = (
                            h * cap * hd + (base + r) * hd,
                            h * cap * hd + (base + j) * hd,
                        );
                        buf.copy_within(from..from + hd, to);
                    }
                }
            }
        }
        self.len = base + rows.len();
        Ok(())
    }

    fn copy_prefix_from(&mut self, src: &dyn SequenceCache, n: usize) -> Result<()> {
        let src = src.as_any().downcast_ref::<KvCache>().ok_or_else(|| {
            crate::error::Error::InvalidArgument(
                "a CPU KV cache can take positions only from another CPU KV cache".into(),
            )
        })?;
        self.copy_prefix(src, n)
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }

    fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
        self
    }
}
