//! Where the tiers read experts from on a miss: the packed store (its records decoded into
//! the expert's matrices here), or the checkpoint itself.

use crate::backend::cpu::Matrix;
use crate::model::checkpoint::Checkpoint;
use crate::model::config::Config;
use crate::model::loader::Loader;
use crate::model::mlp::SwiGlu;
use crate::quant::exl3::Exl3Linear;
use crate::store::{Part, PartFormat, Parts, RecordBuf};
use anyhow::Context;

/// Where experts come from on a miss: the packed store (or, untiered, the checkpoint).
pub trait ExpertSource: Send + Sync {
    fn load(&self, layer: usize, expert: usize) -> anyhow::Result<SwiGlu>;
    /// Several records at once, in `keys` order (the store reads them at queue depth and
    /// checks and decodes them on all cores).
    fn load_many(&self, keys: &[(usize, usize)]) -> Vec<anyhow::Result<SwiGlu>> {
        use rayon::prelude::*;
        keys.par_iter().map(|&(l, e)| self.load(l, e)).collect()
    }
    /// Several records at once, each handed to `deliver` (with its index in `keys`) as soon
    /// as it is read, checked and decoded, on the current rayon pool's threads; every key
    /// exactly once, before this returns.
    fn load_each(
        &self,
        keys: &[(usize, usize)],
        deliver: &(dyn Fn(usize, anyhow::Result<SwiGlu>) + Sync),
    ) {
        use rayon::prelude::*;
        keys.par_iter()
            .enumerate()
            .for_each(|(i, &(l, e))| deliver(i, self.load(l, e)));
    }
    /// Bytes of one expert record as this source stores it.
    fn record_bytes(&self) -> usize;
    /// Bytes an expert's three matrices take in memory, each from a page of its own: what a
    /// slot of the RAM tier's pinned arena must hold ([`super::arena`]). `None` when not
    /// known without reading one, or when they are f32 values (kept as floats, not bytes).
    fn slot_bytes(&self) -> Option<usize> {
        None
    }
    /// Decodes experts straight into slots of `arena` from now on (true), instead of into
    /// buffers of their own that [`super::arena::ArenaSource`] then copies there (false).
    fn place_in(&self, arena: &std::sync::Arc<super::arena::RamArena>) -> bool {
        let _ = arena;
        false
    }
}

/// [`ExpertSource::slot_bytes`] of experts laid out as `parts`.
pub fn slot_bytes_of(parts: &Parts) -> Option<usize> {
    let page = |n: usize| n.div_ceil(crate::store::ALIGN) * crate::store::ALIGN;
    parts
        .all()
        .iter()
        .map(|p| match p.format {
            PartFormat::Rows(crate::quant::Format::F32) => None,
            PartFormat::Rows(_) => Some(page(p.length)),
            PartFormat::Exl3 { rate, .. } => {
                Some(page(Exl3Linear::stream_len(p.cols, p.rows, rate)))
            }
        })
        .sum()
}

/// Experts read from the checkpoint itself (the untiered source, and the tiers' source until
/// a packed store is given).
pub struct CheckpointSource {
    ckpt: Checkpoint,
    cfg: Config,
    record_bytes: usize,
    slot_bytes: Option<usize>,
}

impl CheckpointSource {
    pub fn open(dir: &std::path::Path) -> anyhow::Result<CheckpointSource> {
        let cfg = Config::from_file(&dir.join("config.json"))?;
        let ckpt = Checkpoint::open(dir)?;
        let first = cfg
            .mlp_kinds
            .iter()
            .position(|k| *k == crate::model::config::MlpKind::Moe)
            .ok_or_else(|| anyhow::anyhow!("{} has no MoE layer", dir.display()))?;
        let e = crate::model::moe::load_expert(
            &cfg,
            Loader::new(&ckpt).pp(&format!("layers.{first}.mlp.experts")),
            0,
        )?;
        Ok(CheckpointSource {
            record_bytes: e.storage_bytes(),
            slot_bytes: super::arena::slot_len_of(&e),
            ckpt,
            cfg,
        })
    }

    pub fn config(&self) -> &Config {
        &self.cfg
    }
}

impl ExpertSource for CheckpointSource {
    fn load(&self, layer: usize, expert: usize) -> anyhow::Result<SwiGlu> {
        let experts = Loader::new(&self.ckpt).pp(&format!("layers.{layer}.mlp.experts"));
        Ok(crate::model::moe::load_expert(&self.cfg, experts, expert)?)
    }

    fn record_bytes(&self) -> usize {
        self.record_bytes
    }

    fn slot_bytes(&self) -> Option<usize> {
        self.slot_bytes
    }
}

/// Experts read from the packed store (O_DIRECT, io_uring or pread; each read checked against its CRC-32C).
pub struct StoreSource {
    reader: crate::store::StoreReader,
    limit: f32,
    record_bytes: usize,
    /// The RAM tier's pinned arena, which records are decoded into when it has a free slot.
    arena: std::sync::OnceLock<std::sync::Arc<super::arena::RamArena>>,
}

impl StoreSource {
    /// Opens `store` for the model in `model_dir`, refusing a store made from another model.
    pub fn open(
        store: &std::path::Path,
        model_dir: &std::path::Path,
        cfg: &Config,
    ) -> anyhow::Result<StoreSource> {
        Self::open_with(
            store,
            model_dir,
            cfg,
            crate::store::ReaderOptions::default(),
        )
    }

    /// [`StoreSource::open`] with the reader's options (e.g. how reads are checked).
    pub fn open_with(
        store: &std::path::Path,
        model_dir: &std::path::Path,
        cfg: &Config,
        options: crate::store::ReaderOptions,
    ) -> anyhow::Result<StoreSource> {
        let fingerprint = crate::store::quick_fingerprint(model_dir)?;
        let reader = crate::store::StoreReader::open(store, Some(&fingerprint), options)?;
        Ok(StoreSource {
            record_bytes: reader.manifest().record_size,
            reader,
            limit: cfg.swiglu_limit,
            arena: std::sync::OnceLock::new(),
        })
    }

    pub fn engine_name(&self) -> &'static str {
        self.reader.engine_name()
    }
}

impl ExpertSource for StoreSource {
    fn load(&self, layer: usize, expert: usize) -> anyhow::Result<SwiGlu> {
        let record = self.reader.read(layer, expert)?;
        expert_from_record_in(&record, self.limit, self.arena.get())
    }

    fn load_many(&self, keys: &[(usize, usize)]) -> Vec<anyhow::Result<SwiGlu>> {
        use rayon::prelude::*;
        self.reader
            .read_many(keys)
            .into_par_iter()
            .map(|r| expert_from_record_in(&*r?, self.limit, self.arena.get()))
            .collect()
    }

    fn load_each(
        &self,
        keys: &[(usize, usize)],
        deliver: &(dyn Fn(usize, anyhow::Result<SwiGlu>) + Sync),
    ) {
        // Decoded where it was checked, while the other reads are still in flight.
        self.reader.read_each(keys, &|i, r| {
            deliver(
                i,
                r.map_err(anyhow::Error::from)
                    .and_then(|r| expert_from_record_in(&r, self.limit, self.arena.get())),
            );
        });
    }

    fn record_bytes(&self) -> usize {
        self.record_bytes
    }

    fn place_in(&self, arena: &std::sync::Arc<super::arena::RamArena>) -> bool {
        self.arena.set(arena.clone()).is_ok()
    }

    /// The largest of the store's layouts (a layer may have its own).
    fn slot_bytes(&self) -> Option<usize> {
        let m = self.reader.manifest();
        std::iter::once(&m.parts)
            .chain(m.layer_parts.values())
            .map(slot_bytes_of)
            .try_fold(0, |most, b| b.map(|b| most.max(b)))
    }
}

/// The expert a store record holds, with the model's SwiGLU clamp `limit`: gate, up and down
/// as matrices, their bytes copied out of the record (rows as they are; an EXL3 weight into
/// the layout its fused products read).
pub fn expert_from_record(record: &RecordBuf, limit: f32) -> anyhow::Result<SwiGlu> {
    expert_from_record_in(record, limit, None)
}

/// [`expert_from_record`], its matrices' bytes written straight into a slot of `arena` when it
/// has one free (else into buffers of their own).
pub fn expert_from_record_in(
    record: &RecordBuf,
    limit: f32,
    arena: Option<&std::sync::Arc<super::arena::RamArena>>,
) -> anyhow::Result<SwiGlu> {
    let (parts, bytes) = (record.layout(), record.bytes());
    let placed = match arena {
        Some(arena) => expert_in_slot(parts, bytes, limit, arena),
        None => None,
    };
    placed
        .unwrap_or_else(|| expert_from_bytes(parts, bytes, limit))
        .with_context(|| {
            format!(
                "record of layer {}, expert {}",
                record.layer(),
                record.expert()
            )
        })
}

/// The expert whose record bytes (laid out as `parts`) are `bytes`, as [`expert_from_record`].
pub fn expert_from_bytes(parts: &Parts, bytes: &[u8], limit: f32) -> anyhow::Result<SwiGlu> {
    let matrix = |p: &Part| {
        let stored = &bytes[p.offset..p.offset + p.length];
        match p.format {
            PartFormat::Rows(format) => Ok(Matrix::from_bytes(
                p.rows,
                p.cols,
                format,
                page_padded(stored),
            )?),
            PartFormat::Exl3 { rate, codebook } => Ok::<_, anyhow::Error>(Matrix::from_exl3(
                Exl3Linear::from_stored(p.cols, p.rows, rate, codebook, stored)?,
            )),
        }
    };
    Ok(SwiGlu {
        gate: matrix(&parts.gate)?,
        up: matrix(&parts.up)?,
        down: matrix(&parts.down)?,
        limit,
    })
}

/// The expert of `bytes` (laid out as `parts`) decoded into a slot of `arena`: each row
/// format's rows copied there, each EXL3 trellis laid out there. `None` when a matrix is f32
/// values or the arena has no free slot.
fn expert_in_slot(
    parts: &Parts,
    bytes: &[u8],
    limit: f32,
    arena: &std::sync::Arc<super::arena::RamArena>,
) -> Option<anyhow::Result<SwiGlu>> {
    use crate::quant::exl3::Exl3Parts;
    enum Piece<'a> {
        Rows(crate::quant::Format, &'a [u8]),
        Exl3(Exl3Parts, &'a [u8]),
    }
    let mut pieces = Vec::with_capacity(3);
    for p in parts.all() {
        let stored = &bytes[p.offset..p.offset + p.length];
        pieces.push(match p.format {
            PartFormat::Rows(crate::quant::Format::F32) => return None,
            PartFormat::Rows(format) => Piece::Rows(format, stored),
            PartFormat::Exl3 { rate, codebook } => {
                match Exl3Parts::stored(p.cols, p.rows, rate, codebook, stored) {
                    Ok((layer, trellis)) => Piece::Exl3(layer, trellis),
                    Err(e) => return Some(Err(e.into())),
                }
            }
        });
    }
    let len = |piece: &Piece| match piece {
        Piece::Rows(_, stored) => stored.len(),
        Piece::Exl3(layer, _) => layer.stream_len(),
    };
    let mut slot = arena.lease([len(&pieces[0]), len(&pieces[1]), len(&pieces[2])])?;
    for (i, piece) in pieces.iter().enumerate() {
        match piece {
            Piece::Rows(_, stored) => slot.region(i).copy_from_slice(stored),
            Piece::Exl3(layer, trellis) => layer.lay_out(trellis, slot.region(i)),
        }
    }
    let placed = slot.finish();
    let mut matrices = Vec::with_capacity(3);
    for ((piece, p), held) in pieces.into_iter().zip(parts.all()).zip(placed) {
        matrices.push(match piece {
            Piece::Rows(format, _) => match Matrix::from_bytes(p.rows, p.cols, format, held) {
                Ok(m) => m,
                Err(e) => return Some(Err(e.into())),
            },
            Piece::Exl3(layer, _) => Matrix::from_exl3(layer.with_stream(held)),
        });
    }
    let [gate, up, down]: [Matrix; 3] = matrices.try_into().ok()?;
    Some(Ok(SwiGlu {
        gate,
        up,
        down,
        limit,
    }))
}

/// `bytes` in a buffer with two spare pages after them, so that no two such buffers touch
/// a common page: a RAM-tier resident is registered with CUDA page by page, and a
/// registration overlapping another one's pages is refused (heap neighbours would share the
/// page between them).
pub(crate) fn page_padded(bytes: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(bytes.len() + 2 * 4096);
    v.extend_from_slice(bytes);
    v
}
