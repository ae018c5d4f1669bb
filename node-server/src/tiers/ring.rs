//! The bounded write-back ring: experts leaving a tier (device victims on their way down to
//! RAM, RAM victims being unpinned and freed) are queued here and handled by one background
//! thread, off the lookup path. A full ring blocks the producer (back-pressure) instead of
//! growing, so copies in flight never exceed its capacity.

use std::collections::VecDeque;
use std::sync::{Condvar, Mutex};

pub struct Ring<T> {
    state: Mutex<State<T>>,
    capacity: usize,
    not_empty: Condvar,
    not_full: Condvar,
    idle: Condvar,
}

struct State<T> {
    queue: VecDeque<T>,
    /// Popped but not yet marked done by the consumer.
    working: usize,
    closed: bool,
    high_water: usize,
    stalls: u64,
}

impl<T> Ring<T> {
    pub fn new(capacity: usize) -> Ring<T> {
        let capacity = capacity.max(1);
        Ring {
            state: Mutex::new(State {
                queue: VecDeque::with_capacity(capacity),
                working: 0,
                closed: false,
                high_water: 0,
                stalls: 0,
            }),
            capacity,
            not_empty: Condvar::new(),
            not_full: Condvar::new(),
            idle: Condvar::new(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State<T>> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Queues `item`, waiting while the ring is full. A closed ring hands the item back.
    pub fn push(&self, item: T) -> Result<(), T> {
        let mut s = self.lock();
        if s.queue.len() >= self.capacity && !s.closed {
            s.stalls += 1;
            while s.queue.len() >= self.capacity && !s.closed {
                s = self.not_full.wait(s).unwrap_or_else(|e| e.into_inner());
            }
        }
        if s.closed {
            return Err(item);
        }
        s.queue.push_back(item);
        s.high_water = s.high_water.max(s.queue.len());
        self.not_empty.notify_one();
        Ok(())
    }

    /// The next item, waiting while empty; `None` once closed and drained. The consumer calls
    /// [`Ring::done`] after handling it.
    pub fn pop(&self) -> Option<T> {
        let mut s = self.lock();
        loop {
            if let Some(item) = s.queue.pop_front() {
                s.working += 1;
                self.not_full.notify_one();
                return Some(item);
            }
            if s.closed {
                return None;
            }
            s = self.not_empty.wait(s).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// The consumer finished the item it popped.
    pub fn done(&self) {
        let mut s = self.lock();
        s.working -= 1;
        if s.queue.is_empty() && s.working == 0 {
            self.idle.notify_all();
        }
    }

    /// Waits until every queued item has been handled.
    pub fn wait_idle(&self) {
        let mut s = self.lock();
        while !(s.queue.is_empty() && s.working == 0) {
            s = self.idle.wait(s).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Stops accepting items; the consumer drains what is queued, then `pop` returns `None`.
    pub fn close(&self) {
        self.lock().closed = true;
        self.not_empty.notify_all();
        self.not_full.notify_all();
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn len(&self) -> usize {
        self.lock().queue.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The most items ever queued at once.
    pub fn high_water(&self) -> usize {
        self.lock().high_water
    }

    /// Pushes that had to wait for room.
    pub fn stalls(&self) -> u64 {
        self.lock().stalls
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Duration;

    #[test]
    fn a_full_ring_blocks_the_producer_until_the_consumer_takes_one() {
        let ring = Arc::new(Ring::new(2));
        ring.push(1).unwrap();
        ring.push(2).unwrap();
        let pushed = Arc::new(AtomicBool::new(false));
        let producer = {
            let (ring, pushed) = (ring.clone(), pushed.clone());
            std::thread::spawn(move || {
                ring.push(3).unwrap();
                pushed.store(true, Ordering::SeqCst);
            })
        };
        std::thread::sleep(Duration::from_millis(100));
        assert!(
            !pushed.load(Ordering::SeqCst),
            "push into a full ring returned"
        );
        assert_eq!(ring.len(), 2);
        assert_eq!(ring.pop(), Some(1));
        ring.done();
        producer.join().unwrap();
        assert!(pushed.load(Ordering::SeqCst));
        assert_eq!(ring.high_water(), 2);
        assert_eq!(ring.stalls(), 1);
        assert_eq!((ring.pop(), ring.pop()), (Some(2), Some(3)));
        ring.done();
        ring.done();
        ring.wait_idle();
        ring.close();
        assert_eq!(ring.pop(), None);
        assert_eq!(ring.push(4), Err(4));
    }

    #[test]
    fn the_bound_holds_under_concurrent_producers() {
        let ring = Arc::new(Ring::new(3));
        let consumer = {
            let ring = ring.clone();
            std::thread::spawn(move || {
                let mut got = 0;
                while ring.pop().is_some() {
                    got += 1;
                    std::thread::sleep(Duration::from_micros(50));
                    ring.done();
                }
                got
            })
        };
        let producers: Vec<_> = (0..4)
            .map(|p| {
                let ring = ring.clone();
                std::thread::spawn(move || (0..100).for_each(|i| ring.push(p * 1000 + i).unwrap()))
            })
            .collect();
        producers.into_iter().for_each(|p| p.join().unwrap());
        ring.wait_idle();
        ring.close();
        assert_eq!(consumer.join().unwrap(), 400);
        assert!(ring.high_water() <= 3);
        assert!(
            ring.stalls() > 0,
            "4 producers against a slow consumer must stall"
        );
    }
}
