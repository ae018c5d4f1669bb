//! A MoE step's picks grouped by expert slot, the tables the fused MoE launches read: built on
//! the host ([`PickGroups`], uploaded as [`GroupTables`]) or on the device from the router's
//! picks (`moe_group` in kernels/cuda/moe.cu), so a step whose experts are all resident never
//! brings its picks to the host.

use super::*;
use cudarc::driver::CudaView;

/// A launch's picks grouped by slot: group g is the slot at byte `base[g]` of the arena, its
/// picks `list[start[g] .. start[g] + len[g]]` (pick indices `t * k + j`).
pub(super) struct PickGroups {
    pub base: Vec<i64>,
    pub start: Vec<i32>,
    pub len: Vec<i32>,
    pub list: Vec<i32>,
}

impl PickGroups {
    pub(super) fn new(members: &[Vec<i32>], slots: &[u32], slot_bytes: usize) -> PickGroups {
        let mut g = PickGroups {
            base: slots
                .iter()
                .map(|&s| (s as usize * slot_bytes) as i64)
                .collect(),
            start: Vec::with_capacity(members.len()),
            len: Vec::with_capacity(members.len()),
            list: Vec::new(),
        };
        for m in members {
            g.start.push(g.list.len() as i32);
            g.len.push(m.len() as i32);
            g.list.extend_from_slice(m);
        }
        g
    }

    /// The slot's byte offset of each entry of `list`.
    pub fn entry_base(&self) -> Vec<i64> {
        let mut out = Vec::with_capacity(self.list.len());
        for (&b, &n) in self.base.iter().zip(&self.len) {
            out.extend(std::iter::repeat_n(b, n as usize));
        }
        out
    }
}

/// The int32 tables of [`GroupTables`], in the order they are stored.
#[derive(Clone, Copy)]
pub(super) enum Table {
    /// Each group's first entry.
    Start,
    /// Each group's entries.
    Len,
    /// Each entry's token row.
    Rows,
    /// Each entry's pick index.
    List,
    /// How many groups there are (one value: the kernels read it, so a table built on the
    /// device needs no count on the host).
    Count,
}

/// A step's pick groups on the device in two buffers: the int64 byte offsets (each group's
/// slot, then each entry's) and the int32 tables of [`Table`]. Made from the host's
/// [`PickGroups`] (two uploads), or on the device from the router's picks (`moe_group`
/// in kernels/cuda/moe.cu, whose layout this mirrors: the tables sized for the most groups
/// a step can have, the counts read by the kernels).
pub(super) struct GroupTables {
    longs: CudaSlice<i64>,
    ints: CudaSlice<i32>,
    /// Where each [`Table`] starts in `ints`, and the end of the last.
    at: [usize; 6],
    /// Groups `base` has room for (a launch's grid room: the groups may be fewer).
    groups: usize,
    pub(super) entries: usize,
    /// Picks of the largest group, where the host built the tables; 0 for tables built on
    /// the device (their sizes stay there).
    pub(super) longest: usize,
}

impl GroupTables {
    pub(super) fn upload(cuda: &Cuda, g: &PickGroups, k: usize) -> Result<GroupTables, CudaError> {
        let mut longs = g.base.clone();
        longs.extend(g.entry_base());
        let rows = g.list.iter().map(|&p| p / k as i32);
        let tables: [Vec<i32>; 5] = [
            g.start.clone(),
            g.len.clone(),
            rows.collect(),
            g.list.clone(),
            vec![g.start.len() as i32],
        ];
        let mut at = [0usize; 6];
        for (i, t) in tables.iter().enumerate() {
            at[i + 1] = at[i] + t.len();
        }
        let ints: Vec<i32> = tables.concat();
        Ok(GroupTables {
            longs: cuda.stream.clone_htod(&longs)?,
            ints: cuda.stream.clone_htod(&ints)?,
            at,
            groups: g.start.len(),
            entries: g.list.len(),
            longest: g.len.iter().copied().max().unwrap_or(0) as usize,
        })
    }

    /// The groups of `tokens * k` picks `ids` (the router's expert ids, on the device) by
    /// slot (`slot_of`: `experts` slot indices), built by one launch with nothing coming to
    /// the host. Every pick is an entry.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn on_device(
        cuda: &Cuda,
        ids: &CudaSlice<i32>,
        slot_of: &CudaView<'_, i32>,
        experts: usize,
        tokens: usize,
        k: usize,
        slot_bytes: usize,
    ) -> Result<GroupTables, CudaError> {
        let picks = tokens * k;
        if picks == 0 || picks > GROUP_MAX_PICKS || ids.len() < picks || slot_of.len() < experts {
            return Err(CudaError::Invalid(format!(
                "device grouping of {tokens} x {k} picks over {experts} experts \
                 (at most {GROUP_MAX_PICKS} picks)"
            )));
        }
        let cap = picks;
        let sizes = [cap, cap, picks, picks, 1];
        let mut at = [0usize; 6];
        for (i, n) in sizes.iter().enumerate() {
            at[i + 1] = at[i] + n;
        }
        // SAFETY: `moe_group` writes every value a kernel reads: the first `count` groups'
        // start, len and base, every entry, and the count.
        let mut longs = unsafe { cuda.stream.alloc::<i64>(cap + picks) }?;
        let mut ints = unsafe { cuda.stream.alloc::<i32>(at[5]) }?;
        let (experts_i, picks_i, k_i, bytes, cap_i) = (
            experts as i32,
            picks as i32,
            k as i32,
            slot_bytes as i64,
            cap as i32,
        );
        let mut b = cuda.stream.launch_builder(cuda.kernel("moe_group"));
        b.arg(ids)
            .arg(slot_of)
            .arg(&experts_i)
            .arg(&picks_i)
            .arg(&k_i)
            .arg(&bytes)
            .arg(&cap_i)
            .arg(&mut longs)
            .arg(&mut ints);
        let cfg = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (GROUP_MAX_PICKS as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: picks <= the kernel's MOE_GROUP_MAX threads and shared arrays; ids holds
        // `picks` values, slot_of `experts`; longs and ints are sized for the layout above.
        unsafe { b.launch(cfg) }?;
        Ok(GroupTables {
            longs,
            ints,
            at,
            groups: cap,
            entries: picks,
            longest: 0,
        })
    }

    pub(super) fn base(&self) -> CudaView<'_, i64> {
        self.longs.slice(..self.groups)
    }

    pub(super) fn entry_base(&self) -> CudaView<'_, i64> {
        self.longs.slice(self.groups..self.groups + self.entries)
    }

    pub(super) fn ints(&self, t: Table) -> CudaView<'_, i32> {
        // An empty table still gets a one-value view (never read): a kernel argument needs
        // a pointer.
        let (a, b) = (self.at[t as usize], self.at[t as usize + 1]);
        self.ints
            .slice(a.min(self.ints.len() - 1)..b.max(a + 1).min(self.ints.len()))
    }

    /// Groups the tables have room for (the grid of a launch over every group).
    pub(super) fn groups(&self) -> usize {
        self.groups
    }
}

/// Picks of one step the device grouping takes (`MOE_GROUP_MAX` in kernels/cuda/moe.cu).
pub const GROUP_MAX_PICKS: usize = 256;
