//! Target features waiting to enter an EAGLE-3 head's cache.
//!
//! A served request that is not drafting (the draft budget gave it nothing this step) still gets the target's
//! features of every accepted position, since its head needs them before it drafts again. Reading them to the host
//! at once cost a synchronous readback every step on a GPU (the head server's whole loss at 16 streams on an
//! H200: docs/benchmarks.md, session 19). Where the target's outputs can be kept by reference (a device step's
//! output block), they stay where they are until the head runs over them; rows are read in order, oldest first.

use std::collections::VecDeque;

use crate::error::{Error, Result};
use crate::model::RowMatrix;

/// Target forwards whose rows may wait unread at most; past this the oldest are read. Each holds its step's
/// captured-layer block on the device (shared by the step's requests: 0.3 MB for 16 one-row requests of the
/// qwen2.5-coder-1.5b head, 2.4 MB for 32 requests verifying 3 drafts each), so 128 forwards keep 38-300 MB.
pub const MAX_UNREAD_FORWARDS: usize = 128;

/// Feature rows still in a device's memory, for a head on that device to read where they are (no round trip
/// through the host: on an H200 the readback and upload of a request's rows was most of a batched head round's
/// cost per request). Row i: each captured layer's (address, columns), low to high; `keep` holds the target
/// outputs they live in until the rows are read.
#[derive(Clone)]
pub struct DeviceFeatureRows {
    pub rows: Vec<Vec<(u64, usize)>>,
    keep: std::sync::Arc<std::sync::Mutex<Vec<Box<dyn RowMatrix>>>>,
}

impl std::fmt::Debug for DeviceFeatureRows {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceFeatureRows")
            .field("rows", &self.rows.len())
            .field(
                "held_matrices",
                &self.keep.lock().map(|k| k.len()).unwrap_or_default(),
            )
            .finish()
    }
}

/// Rows of one target forward, not yet read: one view per captured layer (low to high) and the rows that stay.
struct UnreadRows {
    layers: Vec<Box<dyn RowMatrix>>,
    kept: Vec<usize>,
}

/// Feature rows (`width` = 3H floats each, low ++ mid ++ high) in position order: those already on the host,
/// then those still in the target's outputs.
pub struct WaitingFeatures {
    width: usize,
    host: Vec<f32>,
    unread: VecDeque<UnreadRows>,
    unread_rows: usize,
}

impl WaitingFeatures {
    pub fn new(width: usize) -> Self {
        WaitingFeatures {
            width,
            host: Vec::new(),
            unread: VecDeque::new(),
            unread_rows: 0,
        }
    }

    /// Rows waiting, read or not.
    pub fn rows(&self) -> usize {
        self.host.len() / self.width.max(1) + self.unread_rows
    }

    /// Rows waiting on the host (they come first).
    pub fn host_rows(&self) -> usize {
        self.host.len() / self.width.max(1)
    }

    pub fn clear(&mut self) {
        self.host.clear();
        self.unread.clear();
        self.unread_rows = 0;
    }

    /// Keeps the first `rows` rows.
    pub fn truncate(&mut self, rows: usize) -> Result<()> {
        if rows < self.rows() {
            self.read_all()?;
            self.host.truncate(rows * self.width);
        }
        Ok(())
    }

    /// Appends the `kept` rows of one target forward (`layers`: one matrix per captured layer, low to high, each
    /// `width / layers.len()` wide). Kept by reference where the matrices can be shared; read now otherwise.
    pub fn push(&mut self, layers: &[&dyn RowMatrix], kept: &[usize]) -> Result<()> {
        let cols: usize = layers.iter().map(|m| m.cols()).sum();
        if cols != self.width {
            return Err(Error::InvalidArgument(format!(
                "EAGLE-3 drafter: captured layers {cols} wide in all, the head reads {}",
                self.width
            )));
        }
        for m in layers {
            if let Some(&bad) = kept.iter().find(|&&r| r >= m.rows()) {
                return Err(Error::InvalidArgument(format!(
                    "EAGLE-3 drafter: kept row {bad} of a {}-row target forward",
                    m.rows()
                )));
            }
        }
        if kept.is_empty() {
            return Ok(());
        }
        let shared: Option<Vec<Box<dyn RowMatrix>>> = layers.iter().map(|m| m.share()).collect();
        match shared {
            Some(views) => {
                self.unread.push_back(UnreadRows {
                    layers: views,
                    kept: kept.to_vec(),
                });
                self.unread_rows += kept.len();
                while self.unread.len() > MAX_UNREAD_FORWARDS {
                    self.read_oldest()?;
                }
                Ok(())
            }
            None => {
                // Host rows come after every unread one.
                self.read_all()?;
                append_rows(&mut self.host, layers, kept)
            }
        }
    }

    /// Removes and returns the first `rows` rows (all when fewer wait), reading only the forwards they come from.
    pub fn take_rows(&mut self, rows: usize) -> Result<Vec<f32>> {
        while self.host.len() < rows * self.width && !self.unread.is_empty() {
            self.read_oldest()?;
        }
        let n = (rows * self.width).min(self.host.len());
        Ok(self.host.drain(..n).collect())
    }

    /// Removes the first `rows` rows (every one waiting when fewer do) where they all still lie in a device's
    /// memory: their addresses, nothing read. None (nothing removed) when some of them are on the host or in
    /// host matrices: `take_rows` reads them then.
    pub fn take_device_rows(&mut self, rows: usize) -> Result<Option<DeviceFeatureRows>> {
        let rows = rows.min(self.rows());
        if rows == 0 || !self.host.is_empty() {
            return Ok(None);
        }
        let mut need = rows;
        for u in &self.unread {
            if u.layers.iter().any(|m| m.device_address().is_none()) {
                return Ok(None);
            }
            if u.kept.len() >= need {
                break;
            }
            need -= u.kept.len();
        }
        let mut rows_out = Vec::with_capacity(rows);
        let mut keep = Vec::new();
        let mut need = rows;
        while need > 0 {
            let u = self.unread.front_mut().ok_or_else(|| {
                Error::InvalidArgument("EAGLE-3 drafter: waiting rows went missing".into())
            })?;
            let take = need.min(u.kept.len());
            for &r in &u.kept[..take] {
                let mut parts = Vec::with_capacity(u.layers.len());
                for m in &u.layers {
                    let base = m.device_address().ok_or_else(|| {
                        Error::InvalidArgument(
                            "EAGLE-3 drafter: a device row lost its address".into(),
                        )
                    })?;
                    parts.push((base + (4 * r * m.cols()) as u64, m.cols()));
                }
                rows_out.push(parts);
            }
            // The rows' memory stays held until the pass that reads them is queued.
            for m in &u.layers {
                keep.push(m.share().ok_or_else(|| {
                    Error::InvalidArgument("EAGLE-3 drafter: device rows could not be kept".into())
                })?);
            }
            u.kept.drain(..take);
            if u.kept.is_empty() {
                self.unread.pop_front();
            }
            self.unread_rows -= take;
            need -= take;
        }
        Ok(Some(DeviceFeatureRows {
            rows: rows_out,
            keep: std::sync::Arc::new(std::sync::Mutex::new(keep)),
        }))
    }

    /// Every waiting row on the host (read if need be).
    pub fn read_all(&mut self) -> Result<&[f32]> {
        while !self.unread.is_empty() {
            self.read_oldest()?;
        }
        Ok(&self.host)
    }

    /// A copy of every waiting row, leaving the unread ones where they are.
    pub fn to_vec(&self) -> Result<Vec<f32>> {
        self.leading_rows(usize::MAX)
    }

    /// A copy of the rows read already and those of the oldest `max_forwards` unread forwards (a prefix of the
    /// waiting rows), leaving the unread ones where they are.
    pub fn leading_rows(&self, max_forwards: usize) -> Result<Vec<f32>> {
        let mut out = self.host.clone();
        for u in self.unread.iter().take(max_forwards) {
            let layers: Vec<&dyn RowMatrix> = u.layers.iter().map(|m| m.as_ref()).collect();
            append_rows(&mut out, &layers, &u.kept)?;
        }
        Ok(out)
    }

    /// The first `rows` waiting rows (every one when fewer wait) as a new queue, reading nothing: host rows are
    /// copied, rows still in the target's outputs are shared where they lie (a prefix cache keeps a finished
    /// request's rows so: reading them cost ~0.5 ms of synchronous copies between steps on an H200, every
    /// request waiting). Rows of outputs that cannot be shared are read.
    pub fn first_rows(&self, rows: usize) -> Result<WaitingFeatures> {
        let mut out = WaitingFeatures::new(self.width);
        let from_host = rows.min(self.host_rows());
        out.host
            .extend_from_slice(&self.host[..from_host * self.width]);
        let mut need = rows - from_host;
        for u in &self.unread {
            if need == 0 {
                break;
            }
            let take = need.min(u.kept.len());
            let kept = &u.kept[..take];
            let shared: Option<Vec<Box<dyn RowMatrix>>> =
                u.layers.iter().map(|m| m.share()).collect();
            match shared {
                Some(layers) => {
                    out.unread.push_back(UnreadRows {
                        layers,
                        kept: kept.to_vec(),
                    });
                    out.unread_rows += take;
                }
                None => {
                    // Host rows stay ahead of unread ones.
                    out.read_all()?;
                    let layers: Vec<&dyn RowMatrix> = u.layers.iter().map(|m| m.as_ref()).collect();
                    append_rows(&mut out.host, &layers, kept)?;
                }
            }
            need -= take;
        }
        Ok(out)
    }

    /// Rows on the host and in the oldest `forwards` unread forwards.
    pub fn rows_of_forwards(&self, forwards: usize) -> usize {
        self.host_rows()
            + self
                .unread
                .iter()
                .take(forwards)
                .map(|u| u.kept.len())
                .sum::<usize>()
    }

    /// Device bytes the target outputs its unread rows live in take (each whole output, shared or not): what
    /// keeping this queue holds on a device.
    pub fn held_bytes(&self) -> usize {
        self.unread
            .iter()
            .flat_map(|u| &u.layers)
            .filter(|m| m.device_address().is_some())
            .map(|m| m.rows() * m.cols() * std::mem::size_of::<f32>())
            .sum()
    }

    /// Appends rows already on the host.
    pub fn extend_host(&mut self, rows: &[f32]) -> Result<()> {
        self.read_all()?;
        self.host.extend_from_slice(rows);
        Ok(())
    }

    fn read_oldest(&mut self) -> Result<()> {
        let Some(u) = self.unread.pop_front() else {
            return Ok(());
        };
        self.unread_rows -= u.kept.len();
        let layers: Vec<&dyn RowMatrix> = u.layers.iter().map(|m| m.as_ref()).collect();
        append_rows(&mut self.host, &layers, &u.kept)
    }
}

/// Appends rows `kept` of `layers` side by side (each layer read to the host once: one copy from a device).
fn append_rows(out: &mut Vec<f32>, layers: &[&dyn RowMatrix], kept: &[usize]) -> Result<()> {
    let mats = layers
        .iter()
        .map(|m| Ok((m.cols(), m.to_host()?)))
        .collect::<Result<Vec<_>>>()?;
    for &r in kept {
        for (cols, m) in &mats {
            out.extend_from_slice(&m[r * cols..(r + 1) * cols]);
        }
    }
    Ok(())
}

/// A host matrix that can be shared without a copy, and counts its reads: stands in for a device's step outputs.
#[cfg(test)]
pub(crate) struct SharedRows {
    pub matrix: std::sync::Arc<crate::model::forward::HostRows>,
    pub reads: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    /// A pretend device address of element (0, 0) (`device_address`), to check the bookkeeping of device rows.
    pub address: Option<u64>,
}

#[cfg(test)]
impl SharedRows {
    pub fn new(m: crate::model::forward::HostRows) -> Self {
        SharedRows {
            matrix: std::sync::Arc::new(m),
            reads: Default::default(),
            address: None,
        }
    }

    pub fn on_device(m: crate::model::forward::HostRows, address: u64) -> Self {
        SharedRows {
            address: Some(address),
            ..SharedRows::new(m)
        }
    }

    pub fn reads(&self) -> usize {
        self.reads.load(std::sync::atomic::Ordering::Relaxed)
    }
}

#[cfg(test)]
impl RowMatrix for SharedRows {
    fn rows(&self) -> usize {
        self.matrix.rows
    }
    fn cols(&self) -> usize {
        self.matrix.cols
    }
    fn argmax_rows(&self) -> Result<Vec<u32>> {
        self.matrix.argmax_rows()
    }
    fn row(&self, i: usize) -> Result<std::borrow::Cow<'_, [f32]>> {
        self.reads
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        RowMatrix::row(&*self.matrix, i)
    }
    fn to_host(&self) -> Result<std::borrow::Cow<'_, [f32]>> {
        self.reads
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.matrix.to_host()
    }
    fn share(&self) -> Option<Box<dyn RowMatrix>> {
        Some(Box::new(SharedRows {
            matrix: self.matrix.clone(),
            reads: self.reads.clone(),
            address: self.address,
        }))
    }
    fn device_address(&self) -> Option<u64> {
        self.address
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::forward::HostRows;

    /// A `rows x cols` matrix whose values name their forward, row and column.
    fn matrix(forward: usize, layer: usize, rows: usize, cols: usize) -> HostRows {
        HostRows {
            rows,
            cols,
            data: (0..rows * cols)
                .map(|i| (forward * 10_000 + layer * 1_000 + i) as f32)
                .collect(),
        }
    }

    /// Rows `kept` of the layers side by side, written out directly.
    fn expected(layers: &[HostRows], kept: &[usize]) -> Vec<f32> {
        let mut out = Vec::new();
        for &r in kept {
            for m in layers {
                out.extend_from_slice(m.row(r));
            }
        }
        out
    }

    #[test]
    fn shared_rows_wait_unread_and_come_back_in_order() {
        let (cols, width) = (4, 12);
        let mut w = WaitingFeatures::new(width);
        let mut want = Vec::new();
        let mut shared = Vec::new();
        let layers_of =
            |f: usize| -> Vec<HostRows> { (0..3).map(|l| matrix(f, l, 2 + f % 3, cols)).collect() };
        // Three forwards kept by reference (a device's outputs), every other row kept.
        for f in 0..3 {
            let layers = layers_of(f);
            let kept: Vec<usize> = (0..layers[0].rows).step_by(2).collect();
            want.extend(expected(&layers, &kept));
            let views: Vec<SharedRows> = layers.into_iter().map(SharedRows::new).collect();
            let refs: Vec<&dyn RowMatrix> = views.iter().map(|v| v as &dyn RowMatrix).collect();
            w.push(&refs, &kept).unwrap();
            shared.push(views);
        }
        let reads = |s: &[Vec<SharedRows>]| -> Vec<usize> {
            s.iter()
                .map(|v| v.iter().map(|m| m.reads()).sum())
                .collect()
        };
        assert_eq!(w.rows() * width, want.len());
        assert_eq!(
            reads(&shared),
            [0, 0, 0],
            "nothing read before it is needed"
        );
        // The first row comes from forward 0 only: one read a layer there, none elsewhere.
        assert_eq!(w.take_rows(1).unwrap(), want[..width]);
        assert_eq!(reads(&shared), [3, 0, 0]);
        // A forward that cannot be kept by reference is read at once, behind every waiting row.
        let layers = layers_of(3);
        want.extend(expected(&layers, &[1, 0]));
        let refs: Vec<&dyn RowMatrix> = layers.iter().map(|v| v as &dyn RowMatrix).collect();
        w.push(&refs, &[1, 0]).unwrap();
        assert_eq!(reads(&shared), [3, 3, 3]);
        let rest = w.rows();
        assert_eq!(w.take_rows(rest + 5).unwrap(), want[width..]);
        assert_eq!(w.rows(), 0);
    }

    #[test]
    fn device_rows_are_taken_by_address_in_order_without_a_read() {
        let (cols, width) = (4, 8);
        let mut w = WaitingFeatures::new(width);
        // Two forwards on a pretend device: forward f's layer l at address 1_000_000 * (f + 1) + 10_000 * l.
        let mut views = Vec::new();
        for (f, kept) in [(0usize, vec![0usize, 2]), (1, vec![1])] {
            let layers: Vec<SharedRows> = (0..2)
                .map(|l| {
                    SharedRows::on_device(
                        matrix(f, l, 3, cols),
                        1_000_000 * (f as u64 + 1) + 10_000 * l as u64,
                    )
                })
                .collect();
            let refs: Vec<&dyn RowMatrix> = layers.iter().map(|v| v as &dyn RowMatrix).collect();
            w.push(&refs, &kept).unwrap();
            views.push(layers);
        }
        let row = |f: u64, r: u64| -> Vec<(u64, usize)> {
            (0..2u64)
                .map(|l| (1_000_000 * (f + 1) + 10_000 * l + 4 * r * cols as u64, cols))
                .collect()
        };
        // Three rows wait; the first two come from forward 0 (its rows 0 and 2), one then from forward 1.
        let first = w.take_device_rows(2).unwrap().expect("device rows");
        assert_eq!(first.rows, vec![row(0, 0), row(0, 2)]);
        assert_eq!(w.rows(), 1);
        let rest = w.take_device_rows(5).unwrap().expect("device rows");
        assert_eq!(rest.rows, vec![row(1, 1)]);
        assert_eq!(w.rows(), 0);
        assert!(w.take_device_rows(1).unwrap().is_none(), "nothing waits");
        let reads: usize = views.iter().flatten().map(|m| m.reads()).sum();
        assert_eq!(reads, 0, "device rows are taken without reading them");

        // A row on the host first, or a forward in host memory: nothing is taken, take_rows reads as before.
        let layers: Vec<SharedRows> = (0..2)
            .map(|l| SharedRows::on_device(matrix(2, l, 1, cols), 5_000_000 + l as u64))
            .collect();
        let refs: Vec<&dyn RowMatrix> = layers.iter().map(|v| v as &dyn RowMatrix).collect();
        w.extend_host(&[7.0; 8]).unwrap();
        w.push(&refs, &[0]).unwrap();
        assert!(w.take_device_rows(2).unwrap().is_none());
        assert_eq!(w.rows(), 2);
        let mut host_only = WaitingFeatures::new(width);
        let plain: Vec<SharedRows> = (0..2)
            .map(|l| SharedRows::new(matrix(3, l, 1, cols)))
            .collect();
        let refs: Vec<&dyn RowMatrix> = plain.iter().map(|v| v as &dyn RowMatrix).collect();
        host_only.push(&refs, &[0]).unwrap();
        assert!(host_only.take_device_rows(1).unwrap().is_none());
        assert_eq!(host_only.rows(), 1);
    }

    #[test]
    fn first_rows_share_what_waits_unread_and_read_nothing() {
        let (cols, width) = (2, 4);
        let mut w = WaitingFeatures::new(width);
        w.extend_host(&[9.0; 8]).unwrap();
        let mut views = Vec::new();
        let mut want = vec![9.0; 8];
        for f in 0..3 {
            let layers: Vec<SharedRows> = (0..2)
                .map(|l| SharedRows::on_device(matrix(f, l, 2, cols), 1 << (20 + f + l)))
                .collect();
            want.extend(expected(
                &layers
                    .iter()
                    .map(|s| (*s.matrix).clone())
                    .collect::<Vec<_>>(),
                &[1, 0],
            ));
            let refs: Vec<&dyn RowMatrix> = layers.iter().map(|v| v as &dyn RowMatrix).collect();
            w.push(&refs, &[1, 0]).unwrap();
            views.push(layers);
        }
        // 2 host rows, then 2 rows from each of 3 forwards.
        assert_eq!(w.rows_of_forwards(2), 6);
        let reads = |views: &[Vec<SharedRows>]| -> usize {
            views.iter().flatten().map(|m| m.reads()).sum()
        };
        for n in [0, 1, 2, 3, 5, 8, 20] {
            let before = reads(&views);
            let first = w.first_rows(n).unwrap();
            assert_eq!(first.rows(), n.min(8), "{n}");
            assert_eq!(
                reads(&views),
                before,
                "first_rows({n}) read a device forward"
            );
            // Each shared forward's whole output counts (2 rows x 2 layers x 2 columns x 4 bytes).
            assert_eq!(first.held_bytes(), first.unread.len() * 2 * 2 * 2 * 4);
            assert_eq!(first.to_vec().unwrap(), want[..n.min(8) * width], "{n}");
        }
        assert_eq!(w.to_vec().unwrap(), want, "the queue itself is unchanged");
    }

    #[test]
    fn truncation_and_the_cap_keep_the_rows_exact() {
        let (cols, width) = (2, 6);
        let mut w = WaitingFeatures::new(width);
        let mut want = Vec::new();
        for f in 0..MAX_UNREAD_FORWARDS + 3 {
            let layers: Vec<SharedRows> = (0..3)
                .map(|l| SharedRows::new(matrix(f, l, 1, cols)))
                .collect();
            want.extend(expected(
                &layers
                    .iter()
                    .map(|s| (*s.matrix).clone())
                    .collect::<Vec<_>>(),
                &[0],
            ));
            let refs: Vec<&dyn RowMatrix> = layers.iter().map(|v| v as &dyn RowMatrix).collect();
            w.push(&refs, &[0]).unwrap();
        }
        assert!(w.unread.len() <= MAX_UNREAD_FORWARDS);
        assert_eq!(
            w.host.len(),
            3 * width,
            "the oldest forwards past the cap were read"
        );
        assert_eq!(w.to_vec().unwrap(), want);
        assert_eq!(w.leading_rows(2).unwrap(), want[..5 * width]);
        w.truncate(5).unwrap();
        assert_eq!(w.rows(), 5);
        assert_eq!(w.read_all().unwrap(), &want[..5 * width]);
        w.extend_host(&[1.0; 6]).unwrap();
        assert_eq!(w.rows(), 6);
    }

    #[test]
    fn bad_rows_and_widths_are_refused() {
        let mut w = WaitingFeatures::new(6);
        let layers: Vec<HostRows> = (0..3).map(|l| matrix(0, l, 2, 2)).collect();
        let refs: Vec<&dyn RowMatrix> = layers.iter().map(|v| v as &dyn RowMatrix).collect();
        let e = w.push(&refs, &[2]).unwrap_err().to_string();
        assert!(e.contains("kept row 2 of a 2-row"), "{e}");
        let e = w.push(&refs[..2], &[0]).unwrap_err().to_string();
        assert!(e.contains("4 wide in all, the head reads 6"), "{e}");
        assert_eq!(w.rows(), 0);
    }
}
