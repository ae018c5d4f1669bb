//! [`Device::beside`] on the GPU: a second stream of the device for work independent of the
//! main stream's (the shared experts beside the routed ones), ordered against it by events.

use super::*;

/// A second queue of the device ([`Cuda::side`]) and the events that order it against the
/// first.
pub(super) struct Side {
    gpu: Box<Gpu>,
    events: [cudarc::driver::CudaEvent; 3],
}

/// Whether [`Device::beside`] runs its side work on a second stream: on unless
/// `GLMFLASH_SIDE_STREAM=0` (one stream, for A/B runs; H100 2026-12-06: 1.05-1.07x at one
/// stream, 1.04x at four, the same bits).
pub fn side_stream() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("GLMFLASH_SIDE_STREAM").map_or(true, |v| v != "0"))
}

impl Gpu {
    /// The second queue, made now if it is not yet.
    pub(super) fn side_queue(&self) -> anyhow::Result<std::sync::MutexGuard<'_, Option<Side>>> {
        let cell = self.side.as_ref().expect("called with a side queue");
        let mut side = cell.lock().unwrap_or_else(|e| e.into_inner());
        if side.is_none() {
            let cuda = self.cuda.side()?;
            let events = [cuda.event()?, cuda.event()?, cuda.event()?];
            let gpu = Gpu {
                cuda,
                profile: self.profile.clone(),
                host_profile: self.host_profile,
                waited_ns: Default::default(),
                side: None,
                graphs: Default::default(),
            };
            *side = Some(Side {
                gpu: Box::new(gpu),
                events,
            });
        }
        Ok(side)
    }

    /// [`Device::beside`]: with a second queue (and no profile that times phases alone),
    /// `side` queued there after everything queued here so far, `main` here, `join` here
    /// after both; `side`'s results are freed on its queue once `join` has read them.
    pub(super) fn run_beside<A, B, C>(
        &self,
        side: impl FnOnce(&Self) -> anyhow::Result<A>,
        main: impl FnOnce(&Self) -> anyhow::Result<B>,
        join: impl FnOnce(&Self, &A, B) -> anyhow::Result<C>,
    ) -> anyhow::Result<C> {
        if self.side.is_none() || (self.profile.is_some() && !self.host_profile) {
            let a = side(self)?;
            let b = main(self)?;
            return join(self, &a, b);
        }
        let queue = self.side_queue()?;
        let Side { gpu, events } = queue.as_ref().expect("made above");
        gpu.cuda.after(&self.cuda, &events[0])?;
        let out = (|| {
            let a = side(gpu)?;
            let b = main(self)?;
            self.cuda.after(&gpu.cuda, &events[1])?;
            let c = join(self, &a, b);
            let ordered = gpu.cuda.after(&self.cuda, &events[2]);
            drop(a);
            ordered?;
            c
        })();
        if self.cuda.capturing() {
            // A capture ends on the stream it began on: the side queue's last work (the free)
            // joins back into it, after an error too.
            self.cuda.after(&gpu.cuda, &events[0])?;
        }
        out
    }
}
