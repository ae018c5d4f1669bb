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
    /// The groups of one entry.
    Ones,
    /// The groups of more.
    More,
    /// How many groups `Ones` and `More` list.
    Counts,
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
    at: [usize; 8],
    /// Groups `base` has room for.
    groups: usize,
    pub(super) entries: usize,
    /// The grid's room for the groups listed in `Ones` and in `More`.
    room: [usize; 2],
}

impl GroupTables {
    pub(super) fn upload(cuda: &Cuda, g: &PickGroups, k: usize) -> Result<GroupTables, CudaError> {
        let mut longs = g.base.clone();
        longs.extend(g.entry_base());
        let rows = g.list.iter().map(|&p| p / k as i32);
        let (ones, more): (Vec<i32>, Vec<i32>) =
            (0..g.start.len() as i32).partition(|&i| g.len[i as usize] == 1);
        let room = [ones.len(), more.len()];
        let tables: [Vec<i32>; 7] = [
            g.start.clone(),
            g.len.clone(),
            rows.collect(),
            g.list.clone(),
            ones,
            more,
            room.map(|r| r as i32).to_vec(),
        ];
        let mut at = [0usize; 8];
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
            room,
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
        let sizes = [cap, cap, picks, picks, cap, cap, 2];
        let mut at = [0usize; 8];
        for (i, n) in sizes.iter().enumerate() {
            at[i + 1] = at[i] + n;
        }
        // SAFETY: `moe_group` writes every value a kernel reads: the first `count` groups'
        // start, len and base, every entry, `count` ids of ones and more, and the counts.
        let mut longs = unsafe { cuda.stream.alloc::<i64>(cap + picks) }?;
        let mut ints = unsafe { cuda.stream.alloc::<i32>(at[7]) }?;
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
        // One token's picks are distinct experts: no group of more than one.
        let more = if tokens == 1 { 0 } else { picks / 2 };
        Ok(GroupTables {
            longs,
            ints,
            at,
            groups: cap,
            entries: picks,
            room: [picks, more],
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

    /// The count of groups `Ones` or `More` lists, on the device.
    pub(super) fn count(&self, t: Table) -> CudaView<'_, i32> {
        let i = self.at[Table::Counts as usize] + matches!(t, Table::More) as usize;
        self.ints.slice(i..i + 1)
    }

    /// The grid's room for the groups `Ones` or `More` lists.
    pub(super) fn room(&self, t: Table) -> usize {
        self.room[matches!(t, Table::More) as usize]
    }
}

/// Picks of one step the device grouping takes (`MOE_GROUP_MAX` in kernels/cuda/moe.cu).
pub const GROUP_MAX_PICKS: usize = 256;
